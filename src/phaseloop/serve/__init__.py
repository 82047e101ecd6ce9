"""`phaseloop serve`: a trained model behind an OpenAI-compatible API, with the depth and
exit rule of a weight-tied trunk chosen per request, and concurrent requests batched.

Layout (docs/serve.md):
- ``net.py``       listening sockets (explore's server uses them too)
- ``loading.py``   what is served: a run or an exported folder, its tokenizer, chat template, quantised weights
- ``schema.py``    the request bodies, checked field by field (400 naming the field)
- ``options.py``   the per-request phaseloop options (``depth``, ``exit``, ...), resolved in one place
- ``sequence.py``  one sequence being generated: sampling, tokens, text, stop sequences, events
- ``engine.py``    the decode loop: continuous batching over the KV cache, bounded queue, deadlines
- ``responses.py`` OpenAI's JSON shapes, log-probabilities, server-sent events
- ``app.py``       the Starlette routes, API key, body limits, errors as OpenAI error objects
- ``metrics.py``   ``/metrics`` (prometheus_client)
- ``runner.py``    uvicorn: ``run`` until Ctrl-C, ``Background`` in a thread

Needs the ``serve`` extra (starlette, uvicorn, prometheus-client; openai for clients);
an exported folder or a chat template also needs ``hf`` (transformers).
"""
