//! The `kiln` command line as a user runs it.

use std::process::Command;

use kiln_tests::{kiln_binary, smollm2_or_skip};

fn kiln(args: &[&str]) -> std::process::Output {
    Command::new(kiln_binary())
        .args(args)
        .output()
        .expect("run kiln")
}

fn stdout(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}
fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn run_json_prints_ids_text_and_timings() {
    let Some(model) = smollm2_or_skip("run_json_prints_ids_text_and_timings") else {
        return;
    };
    let model = model.to_str().unwrap();
    let out = kiln(&[
        "run",
        "The capital of France is",
        "-n",
        "24",
        "--format",
        "json",
        "-m",
        model,
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_str(stdout(&out).trim()).expect("one JSON object");
    assert_eq!(
        v["prompt_ids"],
        serde_json::json!([504, 3575, 282, 4649, 314])
    );
    assert_eq!(v["generated_ids"].as_array().unwrap().len(), 24);
    let text = v["text"].as_str().unwrap();
    assert!(
        text.starts_with(" Paris."),
        "greedy continuation was {text:?}"
    );
    let t = &v["timings"];
    assert!(t["decode_tokens_per_sec"].as_f64().unwrap() > 0.0);
    // Load, time to first token and per-token latency, each on its own.
    let (load, ttft, per) = (
        t["load_ms"].as_f64().unwrap(),
        t["time_to_first_token_ms"].as_f64().unwrap(),
        t["ms_per_token"].as_f64().unwrap(),
    );
    assert!(
        load > 0.0 && ttft >= t["prompt_ms"].as_f64().unwrap() && per > 0.0,
        "{t}"
    );
    let decode_ms = t["decode_ms"].as_f64().unwrap();
    assert!(
        (per * t["decode_steps"].as_f64().unwrap() - decode_ms).abs() < 1e-6 * decode_ms.max(1.0),
        "{t}"
    );
    assert_eq!(v["backend"], "cpu");
}

#[test]
fn run_streams_text_and_summarises_speed() {
    let Some(model) = smollm2_or_skip("run_streams_text_and_summarises_speed") else {
        return;
    };
    let out = kiln(&[
        "run",
        "Water boils at",
        "-n",
        "8",
        "-m",
        model.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).starts_with("Water boils at 100"),
        "{}",
        stdout(&out)
    );
    assert!(stderr(&out).contains("tok/s"), "{}", stderr(&out));
}

#[test]
fn chat_template_and_stop_on_end_of_turn() {
    let Some(model) = smollm2_or_skip("chat_template_and_stop_on_end_of_turn") else {
        return;
    };
    let out = kiln(&[
        "run",
        "What is 2+2?",
        "--chat",
        "-n",
        "64",
        "--format",
        "json",
        "-m",
        model.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_str(stdout(&out).trim()).unwrap();
    assert_eq!(
        v["finish_reason"], "stop",
        "the reply ends with <|im_end|>: {v}"
    );
    assert!(v["text"].as_str().unwrap().contains('4'), "{v}");
    assert!(!v["text"].as_str().unwrap().contains("<|im_end|>"));
}

#[test]
fn stop_strings_cut_the_output() {
    let Some(model) = smollm2_or_skip("stop_strings_cut_the_output") else {
        return;
    };
    let out = kiln(&[
        "run",
        "The capital of France is",
        "-n",
        "24",
        "--stop",
        ".",
        "--format",
        "json",
        "-m",
        model.to_str().unwrap(),
    ]);
    let v: serde_json::Value = serde_json::from_str(stdout(&out).trim()).unwrap();
    assert_eq!(v["text"], " Paris");
    assert_eq!(v["finish_reason"], "stop");
}

#[test]
fn inspect_backends_and_tokenize() {
    let Some(model) = smollm2_or_skip("inspect_backends_and_tokenize") else {
        return;
    };
    let model = model.to_str().unwrap();
    let out = kiln(&["inspect", model]);
    assert!(out.status.success(), "{}", stderr(&out));
    let s = stdout(&out);
    assert!(s.contains("q4_1") && s.contains("210 tensors"), "{s}");
    assert!(s.contains("30 layers, hidden 576"), "{s}");
    assert!(s.contains("* cpu"), "{s}");
    // 30 layers × 8192 positions × 3 KV heads × 64 × (K and V) × 4 bytes.
    assert!(s.contains("kv cache:     377.5 MB per sequence"), "{s}");

    let out = kiln(&["backends", "-m", model]);
    assert!(out.status.success());
    assert!(
        stdout(&out).contains("cpu would run it"),
        "{}",
        stdout(&out)
    );

    let out = kiln(&["tokenize", model, "x =  5<|im_end|>"]);
    let s = stdout(&out);
    assert!(
        s.contains("    256 ") && s.contains("\"<|im_end|>\""),
        "{s}"
    );
}

#[test]
fn bad_files_give_clear_errors() {
    let dir = std::env::temp_dir().join(format!("kiln-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let missing = dir.join("nope.gguf");
    let out = kiln(&["run", "hi", "-m", missing.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("nope.gguf"), "{}", stderr(&out));

    let garbage = dir.join("garbage.gguf");
    std::fs::write(&garbage, b"this is not a model at all").unwrap();
    let out = kiln(&["inspect", garbage.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("kiln: error: invalid model file"),
        "{}",
        stderr(&out)
    );
    assert!(!stderr(&out).contains("panicked"));

    if let Some(model) = kiln_tests::smollm2_path() {
        let bytes = std::fs::read(&model).unwrap();
        let truncated = dir.join("truncated.gguf");
        std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
        let out = kiln(&["run", "hi", "-n", "2", "-m", truncated.to_str().unwrap()]);
        assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
        assert!(!stderr(&out).contains("panicked"), "{}", stderr(&out));
        let out = kiln(&[
            "run",
            "hi",
            "--backend",
            "no-such-backend",
            "-m",
            model.to_str().unwrap(),
        ]);
        assert!(
            stderr(&out).contains("no backend named 'no-such-backend'"),
            "{}",
            stderr(&out)
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// `-n 0` processes the prompt and generates nothing; sampling settings out of range are
/// refused with the setting named, before any work.
#[test]
fn zero_tokens_and_out_of_range_sampling() {
    let Some(model) = smollm2_or_skip("zero_tokens_and_out_of_range_sampling") else {
        return;
    };
    let model = model.to_str().unwrap();
    let out = kiln(&["run", "Hello", "-n", "0", "--format", "json", "-m", model]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_str(stdout(&out).trim()).expect("one JSON object");
    assert_eq!(v["generated_ids"].as_array().unwrap().len(), 0, "{v}");
    for (flag, value, name) in [
        ("--temp", "-1", "temperature"),
        ("--temp", "NaN", "temperature"),
        ("--temp", "inf", "temperature"),
        ("--top-p", "1.5", "top-p"),
        ("--min-p", "-0.5", "min-p"),
        ("--repeat-penalty", "-2", "repeat penalty"),
    ] {
        let arg = format!("{flag}={value}");
        let out = kiln(&["run", "Hello", "-n", "4", &arg, "-m", model]);
        assert!(!out.status.success(), "{flag} {value} was accepted");
        assert!(
            stderr(&out).contains(name),
            "{flag} {value}: {}",
            stderr(&out)
        );
    }
}

/// A context beyond the model's trained length is refused with both numbers.
#[test]
fn context_beyond_the_model_is_refused() {
    let Some(model) = smollm2_or_skip("context_beyond_the_model_is_refused") else {
        return;
    };
    let out = kiln(&[
        "run",
        "Hello",
        "-n",
        "2",
        "-c",
        "4294967295",
        "-m",
        model.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("8192"), "{}", stderr(&out));
}

/// `kiln warmup` loads the model on its backend (compiling GPU kernels into the cache on a
/// GPU), draws one token and says it is ready.
#[test]
fn warmup_loads_and_says_ready() {
    let Some(model) = smollm2_or_skip("warmup_loads_and_says_ready") else {
        return;
    };
    let out = kiln(&["warmup", "-m", model.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("kiln: ready on cpu: loaded in"),
        "{}",
        stderr(&out)
    );
}

/// `kiln bench` reports the KV cache the executor says it keeps (its type and bytes a
/// token), not a guess from the backend's name, and how long the model took to load.
#[test]
fn bench_reports_the_executors_kv_cache() {
    let Some(model) = smollm2_or_skip("bench_reports_the_executors_kv_cache") else {
        return;
    };
    for (kv, bytes_per_value) in [(None, 4.0), (Some("f16"), 2.0), (Some("q8_0"), 34.0 / 32.0)] {
        let mut args = vec![
            "bench",
            "-m",
            model.to_str().unwrap(),
            "-p",
            "0",
            "-n",
            "2",
            "-r",
            "1",
            "-c",
            "64",
            "-o",
            "json",
        ];
        if let Some(kv) = kv {
            args.extend(["--kv-type", kv]);
        }
        let out = kiln(&args);
        assert!(out.status.success(), "{}", stderr(&out));
        let v: serde_json::Value =
            serde_json::from_str(stdout(&out).trim()).expect("one JSON object");
        // SmolLM2: 30 layers of 3 KV heads of 64 values, keys and values.
        let per_token = (2.0 * 30.0 * 3.0 * 64.0 * bytes_per_value) as u64;
        assert_eq!(v["kv_type"], kv.unwrap_or("f32"), "{v}");
        assert_eq!(v["kv_bytes_per_token"], per_token, "{v}");
        assert_eq!(v["kv_bytes"], per_token * 64, "{v}");
        // The paged pool: 64 tokens are two blocks of 32; the tg test's sequence (a
        // one-token prompt and two steps) held one.
        assert_eq!(v["kv_block_tokens"], 32, "{v}");
        assert_eq!(v["kv_block_bytes"], per_token * 32, "{v}");
        assert_eq!(v["kv_blocks_total"], 2, "{v}");
        assert_eq!(v["kv_blocks_in_use"], 1, "{v}");
        // The load it timed (#48's yardstick on the GPUs): a positive, plausible time.
        let load = v["load_s"].as_f64().expect("load_s");
        assert!(load > 0.0 && load < 600.0, "{v}");
    }
}

/// `--kv-mem` sizes the paged KV pool; a malformed or zero size is a usage error naming the
/// flag, and a pool smaller than one sequence's context is refused at load.
#[test]
fn kv_mem_sizes_the_pool() {
    for command in [&["run", "hi"][..], &["bench"], &["serve"], &["chat"]] {
        for bad in ["lots", "0", "12X", "-5M", "1.5.2G", ""] {
            let flag = format!("--kv-mem={bad}");
            let mut args = command.to_vec();
            args.push(&flag);
            let out = kiln(&args);
            assert_eq!(out.status.code(), Some(2), "{args:?}: {}", stderr(&out));
            assert!(
                stderr(&out).contains("--kv-mem"),
                "{args:?}: {}",
                stderr(&out)
            );
        }
    }
    let Some(model) = smollm2_or_skip("kv_mem_sizes_the_pool") else {
        return;
    };
    let model = model.to_str().unwrap();
    // Two sequences of 64 tokens would take 4 blocks of 1.4 MiB (f32); 3MiB holds 2.
    let bench = |kv_mem: Option<&str>| {
        let mut args = vec![
            "bench", "-m", model, "--batch", "2", "-p", "8", "-n", "4", "-c", "64", "-o", "json",
        ];
        if let Some(m) = kv_mem {
            args.extend(["--kv-mem", m]);
        }
        let out = kiln(&args);
        assert!(out.status.success(), "{}", stderr(&out));
        let v: serde_json::Value =
            serde_json::from_str(stdout(&out).trim()).expect("one JSON object");
        v
    };
    let v = bench(None);
    assert_eq!(v["kv_blocks_total"], 4, "{v}");
    let v = bench(Some("3MiB"));
    assert_eq!(v["kv_blocks_total"], 2, "{v}");
    assert_eq!(v["kv_blocks_in_use"], 2, "12 tokens each: {v}");
    assert_eq!(
        v["kv_bytes"],
        2 * v["kv_block_bytes"].as_u64().unwrap(),
        "{v}"
    );
    let out = kiln(&[
        "run", "hi", "-n", "1", "-c", "64", "--kv-mem", "1MiB", "-m", model,
    ]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("less than one sequence's context of 64")
            && stderr(&out).contains("raise --kv-mem"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn bench_at_a_depth_of_context_names_its_tests_like_llama_bench() {
    let Some(model) =
        smollm2_or_skip("bench_at_a_depth_of_context_names_its_tests_like_llama_bench")
    else {
        return;
    };
    let out = kiln(&[
        "bench",
        "-m",
        model.to_str().unwrap(),
        "-p",
        "16",
        "-n",
        "4",
        "-r",
        "1",
        "-d",
        "200",
        "-o",
        "json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_str(stdout(&out).trim()).expect("one JSON object");
    let tests: Vec<&str> = v["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["test"].as_str().unwrap())
        .collect();
    assert_eq!(tests, ["pp16 @ d200", "tg4 @ d200"], "{v}");
    for r in v["results"].as_array().unwrap() {
        assert!(r["mean_tps"].as_f64().unwrap() > 0.0, "{r}");
    }
    // The context is sized to fit the depth: 200 + 16 > the 128 an explicit -c allows.
    let out = kiln(&[
        "bench",
        "-m",
        model.to_str().unwrap(),
        "-p",
        "16",
        "-n",
        "4",
        "-r",
        "1",
        "-d",
        "200",
        "-c",
        "128",
    ]);
    assert!(
        !out.status.success(),
        "a depth past the context must fail: {}",
        stdout(&out)
    );
    assert!(
        stderr(&out).contains("exceed the context of 128"),
        "{}",
        stderr(&out)
    );
    // A depth near usize::MAX is refused as the context it asks for, not wrapped around.
    let out = kiln(&[
        "bench",
        "-m",
        model.to_str().unwrap(),
        "-p",
        "16",
        "-n",
        "4",
        "-r",
        "1",
        "-d",
        &usize::MAX.to_string(),
    ]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains(&format!("a context of {} tokens exceeds", usize::MAX)),
        "{}",
        stderr(&out)
    );
}

#[test]
fn json_schema_makes_the_output_json() {
    let Some(model) = smollm2_or_skip("json_schema_makes_the_output_json") else {
        return;
    };
    let model = model.to_str().unwrap();
    let schema = r#"{"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"], "additionalProperties": false}"#;
    // The same sampled run, the schema given as `flag value`.
    let run = |flag: &str, value: &str| {
        kiln(&[
            "run",
            "Name a city.",
            "--chat",
            "-n",
            "48",
            "--temp",
            "0.9",
            "--seed",
            "4",
            flag,
            value,
            "--format",
            "json",
            "-m",
            model,
        ])
    };
    let out = run("--json-schema", schema);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_str(stdout(&out).trim()).expect("one JSON object");
    assert_eq!(v["finish_reason"], "stop", "{v}");
    let answer: serde_json::Value =
        serde_json::from_str(v["text"].as_str().unwrap()).expect("the text is JSON");
    assert!(
        answer["city"].is_string() && answer.as_object().unwrap().len() == 1,
        "{answer}"
    );

    // From a file, the same schema gives the same answer.
    let file = std::env::temp_dir().join(format!("kiln-schema-{}.json", std::process::id()));
    std::fs::write(&file, schema).unwrap();
    let again = run("--json-schema-file", file.to_str().unwrap());
    std::fs::remove_file(&file).ok();
    let w: serde_json::Value =
        serde_json::from_str(stdout(&again).trim()).expect("one JSON object");
    assert_eq!(w["text"], v["text"]);

    // Bad schemas fail before anything is printed, saying why.
    for (bad, says) in [
        ("{nope", "not JSON"),
        (r#"{"type": "frob"}"#, "cannot be used"),
    ] {
        let out = kiln(&["run", "x", "-n", "4", "--json-schema", bad, "-m", model]);
        assert!(!out.status.success());
        assert!(stdout(&out).is_empty(), "{}", stdout(&out));
        assert!(stderr(&out).contains(says), "{}", stderr(&out));
    }
    let out = kiln(&[
        "run",
        "x",
        "--json-schema-file",
        "/no/such/schema.json",
        "-m",
        model,
    ]);
    assert!(
        !out.status.success() && stderr(&out).contains("/no/such/schema.json"),
        "{}",
        stderr(&out)
    );
    // An endless file is refused after a bounded read, not read into memory.
    if std::path::Path::new("/dev/zero").exists() {
        let out = kiln(&["run", "x", "--json-schema-file", "/dev/zero", "-m", model]);
        assert!(
            !out.status.success() && stderr(&out).contains("longer than"),
            "{}",
            stderr(&out)
        );
    }
}

/// `kiln serve` refuses flags that cannot mean anything before it listens or loads: an
/// empty API key (every request would get 401) and the zero limits.
#[test]
fn serve_refuses_meaningless_flags_at_start() {
    for (args, names) in [
        (&["serve", "--api-key", ""][..], "--api-key"),
        (&["serve", "--api-key", "  "], "--api-key"),
        (&["serve", "--body-limit", "0"], "--body-limit"),
        (&["serve", "--queue", "0"], "--queue"),
        (&["serve", "--max-seqs", "0"], "--max-seqs"),
    ] {
        let out = kiln(&[args, &["--port", "0"]].concat());
        assert!(!out.status.success(), "{args:?} started");
        assert!(stderr(&out).contains(names), "{args:?}: {}", stderr(&out));
        assert!(
            !stderr(&out).contains("listening"),
            "{args:?} listened first: {}",
            stderr(&out)
        );
    }
}

/// `kiln embed`: one JSON vector a text on stdout (unit length by default), the pooling by
/// name; an unknown pooling is an error naming the choices.
#[test]
fn embed_prints_one_vector_a_text() {
    let Some(model) = smollm2_or_skip("embed_prints_one_vector_a_text") else {
        return;
    };
    let model = model.to_str().unwrap();
    let out = kiln(&[
        "embed",
        "-m",
        model,
        "--backend",
        "cpu",
        "one text",
        "another",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let vectors: Vec<Vec<f64>> = stdout(&out)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON array a line"))
        .collect();
    assert_eq!(vectors.len(), 2);
    for v in &vectors {
        assert_eq!(v.len(), 576);
        let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
        assert!((norm - 1.0).abs() < 1e-5, "{norm}");
    }
    let out = kiln(&[
        "embed",
        "-m",
        model,
        "--backend",
        "cpu",
        "--pooling",
        "max",
        "x",
    ]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("mean, cls or last"),
        "{}",
        stderr(&out)
    );
}
