"""Data files shipped with ggufpy (the evaluation text of `ggufpy perplexity`)."""
