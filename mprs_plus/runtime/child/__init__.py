"""The child side: code that runs in a dispatch or worker process."""
