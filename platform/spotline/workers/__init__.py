"""Workers: one Ray actor per device, each hosting a DeepSpeed engine."""
