"""The policy: models and tokenizers, the warm start, the sampler and its decoders, the trainer's forward."""
