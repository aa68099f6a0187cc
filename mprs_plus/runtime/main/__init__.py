"""The main side: code that runs in the training process."""
