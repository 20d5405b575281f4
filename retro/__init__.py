"""Retro: the chunk database (`retro.db`), the chunk embedder (`retro.embedder`), its faiss index
(`retro.index`), the pretraining neighbours (`retro.query`) and the project directory pretraining reads
(`retro.project`); see docs/architecture.md (Retro preprocessing)."""
