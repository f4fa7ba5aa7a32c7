"""What a request is made of: its body shaped for each stage (routing), its media
(fetched, keyed, rewritten) and the Responses API's input."""
