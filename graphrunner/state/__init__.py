"""Per-request state rows, their staged writes, and the validation of scheduler input against them."""
