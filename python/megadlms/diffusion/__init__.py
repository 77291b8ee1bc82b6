"""megadlms.diffusion (being written)."""
