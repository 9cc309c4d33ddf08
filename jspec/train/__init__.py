"""Training drafts with optax: a distilled small Llama and an EAGLE-style feature head."""
