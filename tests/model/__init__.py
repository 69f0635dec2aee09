"""The model (model/) against independent fp64 oracles and its semantics; its config schema and layouts."""
