"""Training data preparation: `kvserve data clean` (see kvserve.data.clean)."""
