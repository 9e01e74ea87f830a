"""The OpenAI-compatible server (`jaxrunner serve`): `async_llm` steps one engine for many clients,
`protocol` reads request bodies, `api_server` answers them, `metrics` counts."""
