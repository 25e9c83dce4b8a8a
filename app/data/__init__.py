"""Input pipeline: sampler -> reader -> decode -> augment -> loader (see each module)."""
