"""The core layer: masking, the objective, the encoder and its kernels, and the pieces every
stage shares (special-token table, named keys, the batch masker, the train state). It imports
nothing else from clozax; see ARCHITECTURE.md."""
