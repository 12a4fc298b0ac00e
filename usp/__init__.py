"""usp: hybrid sequence parallelism (Ulysses x ring attention) for PyTorch."""
