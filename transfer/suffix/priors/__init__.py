"""Induction priors fitted for a target model (`*.safetensors`, `InductionPrior.save`): the terms per query head and
the metadata of how they were fitted (the target's config hash, the adapter, the command). `InductionPrior.for_model`
takes the one whose config hash is the model's."""
