"""The joint limiter: TPM buckets, concurrency slots and leases per key,
the per-key state both stores compute with."""
