"""Stage 5: every build paired item by item with the reference."""
