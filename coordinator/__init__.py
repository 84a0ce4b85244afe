"""The coordinator: stateless front end that runs speculative rounds across draft and target services."""
