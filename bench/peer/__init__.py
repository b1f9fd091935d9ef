"""asrflow against SpeechBrain on the same batches: the jobs of ``bench.peer_speed``."""
