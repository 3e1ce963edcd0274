"""The training loss's epilogues over the LM-head loop: the row blocks (``train_rows``) and the
vocabulary-major recompute (``recompute``)."""
