"""Retro: the chunk database (`retro.db`), its faiss index (`retro.index`) and the pretraining neighbours
(`retro.query`); see docs/architecture.md (Retro preprocessing)."""
