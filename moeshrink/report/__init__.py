"""Stage 6: the HTML report, rendered from the JSON files rules wrote."""
