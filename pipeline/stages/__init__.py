"""The pipeline's stages: `runner` runs one, `chain` holds their order and runs a prefix of them; each other
module is one stage and exposes SPEC. None imports Click."""
