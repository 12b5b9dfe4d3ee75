"""The sweep: a grid of models × corpora × methods × types as content-addressed Ray tasks, one merged report."""
