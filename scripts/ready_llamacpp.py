"""Time from a cold Python process to llama.cpp's first token on a GGUF file (issue 52's start-up row).

    /usr/bin/time -f "%e s %M KB" python scripts/ready_llamacpp.py FILE [TOKEN_IDS]

Imports llama_cpp (llama-cpp-python), loads FILE with a 512-token context and evaluates a few
token ids (default 1,100,200,300: text is not tokenized, so random-vocabulary files work too).
The kvserve side of the row is `kvserve run "Hi" --max-tokens 1 --temperature 0 --model FILE`.
"""

import sys
import time

t0 = time.time()
import numpy as np
from llama_cpp import Llama

model = Llama(model_path=sys.argv[1], n_ctx=512, n_threads=2, verbose=False)
t1 = time.time()
ids = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 100, 200, 300]
model.eval(ids)
tok = int(np.argmax(model.scores[model.n_tokens - 1]))
print(f"llama.cpp import+load {t1 - t0:.2f} s, to first token {time.time() - t0:.2f} s (token {tok})")
