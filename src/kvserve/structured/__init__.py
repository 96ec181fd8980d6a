"""Structured output: grammars that constrain what a request may generate.

    request (response_format, guided_*, structured_outputs, forced tool calls)
      -> StructuredOutputsParams on SamplingParams (kvserve.sampling_params)
      -> grammar.py: one llguidance grammar text, checked and compiled once per distinct text
         (client side, off the event loop with a time limit) -> EngineCoreRequest.structured_output
      -> backend.py: in the core, a matcher per request (a copy of the compiled template); each
         step its next-token bitmask is computed on a worker thread while the forward runs, the
         sampler applies the batch's bitmask in one op, the scheduler advances the matcher with
         the accepted tokens and ends the request when the grammar is complete.

llguidance is imported only here and only when a request asks for a grammar (`import kvserve`
stays light). Install it with the `structured` extra.
"""
