"""What kdeploy does on one host over a connection, each a concept of its own: the deploy lock, the health
gate, parity with the release's record, and the SGLang router. Builds on ``core`` and ``ssh``."""
