"""Data: tokens from sources to global batches: preparation, the token cache, packing, documents."""
