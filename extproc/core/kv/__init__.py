"""The KV-token budget: what each pool's cache can still hold, booked per request,
shared by prefix, divided fairly and across replicas."""
