"""The capacity a request takes and gives back: its KV-budget booking, the class queues, the tokenizer
lanes, slot retry hints, and the charging rule for every ending.
"""
