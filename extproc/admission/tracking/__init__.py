"""An admitted request until it settles: `InFlight`, what the inline profile sees of the answer, what the
lean profile's reader and end reports say, and the lean requests nobody watches.
"""
