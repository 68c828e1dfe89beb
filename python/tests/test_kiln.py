"""The `kiln` Python module against the real SmolLM2 (KILN_TEST_MODEL, or the file `kiln run`
fetches into ~/.cache/kiln/models). Runs under pytest or `python3 -m unittest`; without the
model every test reports itself skipped.

    cargo build --release -p kiln-py && cp target/release/libkiln_py.so target/python/kiln.abi3.so
    PYTHONPATH=target/python python3 -m unittest discover -s python/tests -v
"""
import asyncio
import json
import math
import os
import threading
import unittest

import kiln

MODEL = os.environ.get("KILN_TEST_MODEL") or os.path.expanduser(
    "~/.cache/kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf")
HAVE_MODEL = os.path.exists(MODEL)


@unittest.skipUnless(HAVE_MODEL, f"the real SmolLM2 is not at {MODEL}")
class KilnTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.model = kiln.Model(MODEL, backend="cpu", context=1024, max_sequences=4)

    def test_backends_and_the_model(self):
        verdicts = kiln.backends(MODEL)
        cpu = next(v for v in verdicts if v["name"] == "cpu")
        self.assertGreater(cpu["score"], 0)
        self.assertTrue(all("score" in v or v["refused"] for v in verdicts))
        self.assertEqual(self.model.backend, "cpu")
        self.assertEqual(self.model.vocab_size, 49152)
        self.assertEqual(self.model.context, 1024)

    def test_tokens_round_trip(self):
        ids = self.model.tokenize("Hello, world!", add_special=False)
        self.assertEqual(self.model.detokenize(ids), "Hello, world!")
        chat = self.model.chat_prompt([{"role": "user", "content": "<|im_end|>hi"}])
        # The content's marker spelling stays text: only the template's markup is control.
        im_end = self.model.tokenize("<|im_end|>")[-1]
        self.assertEqual(chat.count(im_end), self.model.detokenize(chat).count("<|im_end|>") - 1)

    def test_greedy_generation_streams_and_chats(self):
        whole = self.model.generate("The capital of France is", max_tokens=12, temperature=0)
        self.assertEqual(whole.finish_reason, "length")
        self.assertEqual(len(whole.token_ids), 12)
        stream = self.model.stream("The capital of France is", max_tokens=12, temperature=0)
        self.assertEqual("".join(stream), whole.text)
        self.assertEqual(stream.finish_reason, "length")
        answer = self.model.chat([{"role": "user", "content": "What is the capital of France?"}],
                                 max_tokens=24, temperature=0)
        self.assertIn("Paris", answer.text)
        self.assertEqual(answer.finish_reason, "stop")
        self.assertEqual(answer.reasoning, "")

    def test_greedy_ids_equal_kiln_run(self):
        # The CLI's greedy continuation (`kiln run --format json`), when the binary is built.
        import subprocess
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        target = os.environ.get("CARGO_TARGET_DIR") or os.path.join(root, "target")
        cli = os.path.join(target, "release", "kiln")
        if not os.path.exists(cli):
            self.skipTest(f"no kiln binary at {cli}")
        prompt = "The capital of France is"
        out = subprocess.run([cli, "run", prompt, "-m", MODEL, "--backend", "cpu", "-n", "16", "--temp", "0",
                              "--format", "json"], capture_output=True, text=True, check=True)
        want = json.loads(out.stdout.strip().splitlines()[-1])
        got = self.model.generate(prompt, max_tokens=16, temperature=0)
        self.assertEqual(want["prompt_ids"], self.model.tokenize(prompt))
        self.assertEqual(got.token_ids, want["generated_ids"])

    def test_threads_and_asyncio_share_one_model(self):
        prompts = ["Once upon a time", "The sky is", "Water boils at", "My favourite food is"]
        alone = [self.model.generate(p, max_tokens=10, temperature=0).text for p in prompts]
        together = [None] * len(prompts)

        def run(i):
            together[i] = self.model.generate(prompts[i], max_tokens=10, temperature=0).text

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.assertEqual(together, alone)

        async def gather():
            return await asyncio.gather(*(asyncio.to_thread(self.model.generate, p, max_tokens=10, temperature=0)
                                          for p in prompts))
        self.assertEqual([c.text for c in asyncio.run(gather())], alone)

    def test_seeds_and_json(self):
        a = self.model.generate("Tell me a story", max_tokens=16, temperature=1.0, seed=7)
        b = self.model.generate("Tell me a story", max_tokens=16, temperature=1.0, seed=7)
        self.assertEqual(a.text, b.text)
        schema = {"type": "object", "required": ["name"], "additionalProperties": False,
                  "properties": {"name": {"type": "string", "maxLength": 20}}}
        c = self.model.chat([{"role": "user", "content": "Give me a name as JSON."}], max_tokens=48,
                            temperature=0.7, seed=3, json_schema=schema)
        self.assertEqual(list(json.loads(c.text)), ["name"])

    def test_embeddings(self):
        vectors = self.model.embed(["The cat sat on the mat.", "Stock markets fell."])
        self.assertEqual(len(vectors), 2)
        for v in vectors:
            self.assertEqual(len(v), 576)
            self.assertAlmostEqual(math.sqrt(sum(x * x for x in v)), 1.0, places=4)

    def test_typed_errors(self):
        with self.assertRaises(kiln.ContextExceededError):
            self.model.generate("word " * 2000, max_tokens=4)
        with self.assertRaises(kiln.InvalidArgumentError):
            self.model.generate("hi", temperature=-1.0)
        with self.assertRaises(kiln.KilnError):
            kiln.Model("/nonexistent/model.gguf")
        self.assertTrue(issubclass(kiln.ContextExceededError, kiln.KilnError))


if __name__ == "__main__":
    unittest.main()
