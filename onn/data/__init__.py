"""Read datasets from files or built-in generators and serve them to Lightning."""
