"""Corpora generated on this machine, for trying the pipeline where no corpus can be downloaded:
``python -m asrflow.generate.spoken_corpus`` speaks sentences with espeak-ng into a folder corpus, either
random words of a word list or real English sentences (:mod:`asrflow.generate.sentences`, from Debian's
``fortunes`` package)."""
