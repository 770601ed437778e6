"""The decision on one request body: `Decision` (grant, refusal or shadow) and the admission on the
prompt's byte bound with its one correction to the exact count.
"""
