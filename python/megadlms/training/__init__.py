"""megadlms.training (being written)."""
