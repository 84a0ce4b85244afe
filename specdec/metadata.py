"""gRPC metadata names the SDK and the coordinator share (no heavy imports: the SDK reads this)."""

# Sent by a client to name itself for the coordinator's fairness and per-client limits.
CLIENT_METADATA = "x-specdec-client"
# Trailing metadata of a RESOURCE_EXHAUSTED reply: milliseconds after which a retry is likely admitted.
RETRY_AFTER_METADATA = "retry-after-ms"
