"""Prefill/decode disaggregation: one request's cache (MLA latents + KDA states) moved from a
prefill instance to a decode instance (docs/disaggregation.md).

- params.py: what a request says about its transfer (the `kv_transfer_params` field);
- wire.py: the typed header and its checks (model identity, layout, checksums);
- connector.py: the connector interface and the inbox of arrived transfers;
- zmq_connector.py: the ZeroMQ implementation (raw bytes + a msgspec header, never pickle);
- transfer.py: the torch side, carrying out SendRequest / ReceiveRequest against the cache;
- proxy.py: the OpenAI-compatible front that routes a request through both instances.
"""
