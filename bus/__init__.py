"""Message bus: subjects, wire messages, the Bus protocol and its NATS / in-memory implementations."""
