"""The target service: holds the target model, its session caches, and the acceptance decision."""
