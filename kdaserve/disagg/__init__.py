"""Prefill/decode disaggregation: one request's cache (MLA latents + KDA states) moved from a
prefill instance to a decode instance (docs/disaggregation.md).

- params.py, field.py: what a request says about its transfer (`kv_transfer_params`);
- handoff.py: the cache operations a transfer needs, for the scheduler (torch-free), and
  the hit query (what the decode instance holds does not travel; its pins: cache/holds.py);
- wire.py: the typed header and its checks (model identity, layout, checksums);
- connector.py: the connector interface and the inbox of arrived transfers;
- zmq_connector.py: the ZeroMQ implementation (raw bytes + a msgspec header, never pickle);
- nixl_connector.py: the NIXL one (same header and control channel; the buffers are READ);
- kv_config.py: an instance's settings from its flags and vLLM's --kv-transfer-config JSON;
- transfer.py, setup.py: the torch side, carrying out SendRequest / ReceiveRequest against
  the cache, and how an engine gets its connector;
- backends.py, proxy.py, proxy_cli.py: `kdaserve proxy`, the OpenAI-compatible front;
- local.py: a prefill and a decode engine in one process (the benchmark, the tests).
"""
