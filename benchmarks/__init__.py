"""Side-by-side measurements of fxfuse against eager and torch.compile (see README.md)."""
