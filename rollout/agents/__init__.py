"""Example agents written only against the official ``openai`` SDK, trained through the recording
proxy (``rollout.proxy``): each is a workflow ``async run(task, base_url, api_key, http_client)``."""
