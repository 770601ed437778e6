"""Where a request enters admission: the path table (metered, free, refused), the metered request whatever
its API, and the rules admission reads of the config.
"""
