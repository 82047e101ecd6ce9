"""Language-model runs: a run described by its [model], [train] and [data] tables
(``runconfig``) and trained on a corpus through the one engine (``train``)."""
