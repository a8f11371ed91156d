"""What every stage stands on: errors, atomic files, provenance, the machine, the config and its schema,
statistics, checkpoint folders and architectures."""
