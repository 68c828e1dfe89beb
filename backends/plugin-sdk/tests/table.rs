//! The function table `export_backend!` generates, called directly as a C host would:
//! version header, argument checking (null pointers, short structs, a host of another
//! major), string ownership, progress-callback lifetime, and executor poisoning after a
//! panic. The kiln host never sends most of these bad arguments; a plugin still has to
//! survive them, since any C program can load it.

use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use kiln_plugin_sdk::abi::*;
use kiln_plugin_sdk::kiln_core::{
    Architecture, Backend, DecodeItem, Error, LayerExecutor, LayerWeights, LoadOptions,
    ModelConfig, ModelIr, ModelWeights, ProgressFn, QType, Result, RopeConfig, SeqId, Support,
    TensorView,
};

kiln_plugin_sdk::export_backend!(
    Tiny::default,
    architectures = [Architecture::Llama, Architecture::Qwen3]
);

#[derive(Default)]
struct Tiny;

/// `(max_context, quantized_activations)` of every `LoadOptions` `Tiny::load` received, so a
/// test can see what the SDK rebuilt from the C struct. Tests run in parallel; each tells
/// its own loads apart by a distinct `max_context`.
static LOADS: Mutex<Vec<(usize, bool)>> = Mutex::new(Vec::new());

impl Backend for Tiny {
    fn name(&self) -> &str {
        "tiny"
    }
    fn description(&self) -> &str {
        "table test backend"
    }
    fn qtypes(&self) -> Vec<QType> {
        vec![QType::F32, QType::Q8_0]
    }
    fn probe(&self) -> Result<String, String> {
        Err("no tiny device here".into())
    }
    fn supports(&self, model: &ModelIr) -> Support {
        Support::Yes {
            score: 42,
            note: format!("{} layers", model.config.num_layers),
        }
    }
    fn load(&self, model: &ModelIr, options: &LoadOptions) -> Result<Box<dyn LayerExecutor>> {
        LOADS
            .lock()
            .unwrap()
            .push((options.max_context, options.quantized_activations));
        if let Some(p) = &options.progress {
            p(1, 2);
        }
        Ok(Box::new(TinyExec {
            config: model.config.clone(),
            progress: options.progress.clone(),
        }))
    }
}

struct TinyExec {
    config: ModelConfig,
    /// Kept past `load` on purpose: the SDK must stop it from reaching the host.
    progress: Option<ProgressFn>,
}

impl LayerExecutor for TinyExec {
    fn config(&self) -> &ModelConfig {
        &self.config
    }
    fn max_context(&self) -> usize {
        8
    }
    fn max_sequences(&self) -> usize {
        1
    }
    fn new_sequence(&mut self) -> Result<SeqId> {
        if let Some(p) = &self.progress {
            p(2, 2);
        }
        Ok(0)
    }
    fn free_sequence(&mut self, _: SeqId) -> Result<()> {
        Ok(())
    }
    fn sequence_len(&self, _: SeqId) -> Result<usize> {
        Ok(0)
    }
    fn truncate_sequence(&mut self, _: SeqId, _: usize) -> Result<()> {
        Err(Error::InvalidArgument("nothing to truncate".into()))
    }
    fn prefill(&mut self, _: SeqId, _: &[u32], logits: &mut [f32]) -> Result<()> {
        logits.fill(1.0);
        Ok(())
    }
    fn decode(&mut self, _: &[DecodeItem], _: &mut [f32]) -> Result<()> {
        panic!("tiny decode panics")
    }
}

fn tiny_model() -> ModelIr {
    let f = |name: &str, dims: Vec<usize>| {
        let n: usize = dims.iter().product();
        TensorView::from_f32(name, dims, &vec![0.5; n]).unwrap()
    };
    ModelIr {
        config: ModelConfig {
            vocab_size: 4,
            hidden_size: 8,
            num_layers: 1,
            num_heads: 2,
            num_kv_heads: 1,
            head_dim: 4,
            ffn_size: 16,
            rope: RopeConfig {
                theta: 1e4,
                rotary_dims: 4,
                ..RopeConfig::default()
            },
            tied_embeddings: true,
            context_length: 8,
            ..ModelConfig::default()
        },
        weights: ModelWeights {
            token_embd: f("tok", vec![8, 4]),
            layers: vec![LayerWeights {
                attn_norm: f("an", vec![8]),
                attn_norm_bias: None,
                attn_q: f("q", vec![8, 8]),
                attn_k: f("k", vec![8, 4]),
                attn_v: f("v", vec![8, 4]),
                attn_q_bias: None,
                attn_k_bias: None,
                attn_v_bias: None,
                attn_q_norm: None,
                attn_k_norm: None,
                attn_out: f("o", vec![8, 8]),
                attn_out_bias: None,
                attn_sinks: None,
                ffn_norm: Some(f("fn", vec![8])),
                ffn_norm_bias: None,
                ffn_gate: None,
                ffn_up: Some(f("up", vec![8, 16])),
                ffn_down: Some(f("down", vec![16, 8])),
                experts: None,
                attn_post_norm: None,
                ffn_post_norm: None,
            }],
            output_norm: f("on", vec![8]),
            output_norm_bias: None,
            output: None,
            rope_freqs: None,
        },
        source: "tiny".into(),
        program: None,
    }
}

// The macro's entry point lives in an anonymous const; reach it by its symbol, as a host does.
extern "C" {
    fn kiln_plugin_entry() -> *const KilnPluginApi;
}

fn api() -> &'static KilnPluginApi {
    // SAFETY: the test passes pointers to live locals (or null on purpose) and handles the table made.
    unsafe { &*kiln_plugin_entry() }
}

/// Copies a plugin string and frees it through the table.
fn take(s: KilnOwnedStr) -> String {
    if s.is_none() {
        return String::new();
    }
    // SAFETY: the test passes pointers to live locals (or null on purpose) and handles the table made.
    let text =
        unsafe { String::from_utf8(std::slice::from_raw_parts(s.ptr, s.len).to_vec()).unwrap() };
    // SAFETY: the test passes pointers to live locals (or null on purpose) and handles the table made.
    unsafe { (api().free_string.unwrap())(s) };
    text
}

fn backend() -> *mut KilnBackend {
    let mut b = std::ptr::null_mut();
    let mut err = KilnOwnedStr::NONE;
    // SAFETY: the test passes pointers to live locals (or null on purpose) and handles the table made.
    let status = unsafe { (api().create_backend.unwrap())(ABI_VERSION, &mut b, &mut err) };
    assert_eq!(status, KilnStatus::OK, "{}", take(err));
    b
}

#[test]
fn header_and_creation() {
    let api = api();
    assert_eq!(api.abi_version, ABI_VERSION);
    assert_eq!(
        api.struct_size as usize,
        std::mem::size_of::<KilnPluginApi>()
    );

    let mut b = std::ptr::null_mut();
    let mut err = KilnOwnedStr::NONE;
    // SAFETY: the test passes pointers to live locals (or null on purpose) and handles the table made.
    let status =
        unsafe { (api.create_backend.unwrap())(pack_version(ABI_MAJOR + 1, 0), &mut b, &mut err) };
    assert_eq!(status, KilnStatus::UNSUPPORTED);
    let msg = take(err);
    assert!(
        msg.contains(&version_string(ABI_VERSION)) && msg.contains(&format!("{}.0", ABI_MAJOR + 1)),
        "{msg}"
    );
    assert!(b.is_null());

    let mut err = KilnOwnedStr::NONE;
    // SAFETY: the test passes pointers to live locals (or null on purpose) and handles the table made.
    let status =
        unsafe { (api.create_backend.unwrap())(ABI_VERSION, std::ptr::null_mut(), &mut err) };
    assert_eq!(status, KilnStatus::INVALID_ARGUMENT);
    assert!(take(err).contains("null"));
}

#[test]
fn describe_probe_supports() {
    let (api, b) = (api(), backend());
    let mut info = KilnBackendInfo::empty();
    info.struct_size = 8;
    let mut err = KilnOwnedStr::NONE;
    // SAFETY: the test passes pointers to live locals (or null on purpose) and handles the table made.
    let status = unsafe { (api.describe.unwrap())(b, &mut info, &mut err) };
    assert_eq!(status, KilnStatus::INVALID_ARGUMENT);
    assert!(take(err).contains("struct_size 8"));

    let mut info = KilnBackendInfo::empty();
    let mut err = KilnOwnedStr::NONE;
    // SAFETY: the test passes pointers to live locals (or null on purpose) and handles the table made.
    let status = unsafe { (api.describe.unwrap())(b, &mut info, &mut err) };
    assert_eq!(status, KilnStatus::OK);
    // SAFETY: the test passes pointers to live locals (or null on purpose) and handles the table made.
    unsafe {
        assert_eq!(info.name.to_str("name", 64).unwrap(), "tiny");
        assert_eq!(
            info.version.to_str("version", 64).unwrap(),
            env!("CARGO_PKG_VERSION")
        );
        assert_eq!(
            std::slice::from_raw_parts(info.qtypes, info.n_qtypes),
            [0, 8]
        );
        assert_eq!(
            std::slice::from_raw_parts(info.architectures, info.n_architectures),
            [0, 3]
        );
    }

    let (mut device, mut err) = (KilnOwnedStr::NONE, KilnOwnedStr::NONE);
    // SAFETY: the test passes pointers to live locals (or null on purpose) and handles the table made.
    let status = unsafe { (api.probe.unwrap())(b, &mut device, &mut err) };
    assert_eq!(status, KilnStatus::UNAVAILABLE);
    assert!(device.is_none());
    assert_eq!(take(err), "no tiny device here");

    let model = tiny_model();
    let buf = ModelDescBuf::new(&model, ABI_VERSION).unwrap();
    let desc = buf.desc();
    let mut out = KilnSupport {
        supported: 7,
        score: 7,
        message: KilnOwnedStr::NONE,
    };
    let mut err = KilnOwnedStr::NONE;
    // SAFETY: the test passes pointers to live locals (or null on purpose) and handles the table made.
    let status = unsafe { (api.supports.unwrap())(b, &desc, &mut out, &mut err) };
    assert_eq!(status, KilnStatus::OK);
    let note = take(std::mem::replace(&mut out.message, KilnOwnedStr::NONE));
    assert_eq!(
        (out.supported, out.score, note.as_str()),
        (1, 42, "1 layers")
    );

    let mut err = KilnOwnedStr::NONE;
    // SAFETY: the test passes pointers to live locals (or null on purpose) and handles the table made.
    let status = unsafe { (api.supports.unwrap())(b, std::ptr::null(), &mut out, &mut err) };
    assert_eq!(status, KilnStatus::FORMAT);
    assert!(take(err).contains("null model descriptor"));
    // SAFETY: the test passes pointers to live locals (or null on purpose) and handles the table made.
    unsafe { (api.destroy_backend.unwrap())(b) };
}

static PROGRESS_CALLS: AtomicU64 = AtomicU64::new(0);

unsafe extern "C" fn count_progress(user: *mut c_void, done: u64, total: u64) {
    assert_eq!(user as usize, 0x5eed);
    assert!(done <= total);
    PROGRESS_CALLS.fetch_add(1, Ordering::SeqCst);
}

#[test]
fn executor_calls_check_arguments_and_poison_after_a_panic() {
    let (api, b) = (api(), backend());
    let model = tiny_model();
    let buf = Arc::new(ModelDescBuf::new(&model, ABI_VERSION).unwrap());
    let desc = buf.desc();
    let options = KilnLoadOptions {
        struct_size: std::mem::size_of::<KilnLoadOptions>() as u32,
        _reserved: 0,
        max_context: 0,
        max_sequences: 0,
        threads: 0,
        progress: Some(count_progress),
        progress_user: 0x5eed as *mut c_void,
        flags: 0,
        _reserved1: 0,
    };
    let mut info = KilnExecutorInfo {
        struct_size: 24,
        _reserved: 0,
        max_context: 0,
        max_sequences: 0,
    };
    let mut e = std::ptr::null_mut();
    let mut err = KilnOwnedStr::NONE;
    // SAFETY: the test passes pointers to live locals (or null on purpose) and handles the table made.
    let status = unsafe { (api.load.unwrap())(b, &desc, &options, &mut e, &mut info, &mut err) };
    assert_eq!(status, KilnStatus::OK, "{}", take(err));
    assert_eq!((info.max_context, info.max_sequences), (8, 1));
    assert_eq!(
        PROGRESS_CALLS.load(Ordering::SeqCst),
        1,
        "progress reported during load"
    );

    // After load, the executor's copy of the callback no longer reaches the host.
    let mut seq = 99;
    let mut err = KilnOwnedStr::NONE;
    // SAFETY: the test passes pointers to live locals (or null on purpose) and handles the table made.
    let status = unsafe { (api.new_sequence.unwrap())(e, &mut seq, &mut err) };
    assert_eq!(status, KilnStatus::OK);
    assert_eq!(seq, 0);
    assert_eq!(
        PROGRESS_CALLS.load(Ordering::SeqCst),
        1,
        "progress after load must be dropped"
    );

    // Null handles and buffers are refused, not dereferenced.
    let mut err = KilnOwnedStr::NONE;
    // SAFETY: the test passes pointers to live locals (or null on purpose) and handles the table made.
    let status = unsafe { (api.new_sequence.unwrap())(std::ptr::null_mut(), &mut seq, &mut err) };
    assert_eq!(status, KilnStatus::INVALID_ARGUMENT);
    take(err);
    let mut logits = [0.0f32; 4];
    let mut err = KilnOwnedStr::NONE;
    // SAFETY: the test passes pointers to live locals (or null on purpose) and handles the table made.
    let status = unsafe {
        (api.prefill.unwrap())(e, 0, std::ptr::null(), 3, logits.as_mut_ptr(), 4, &mut err)
    };
    assert_eq!(status, KilnStatus::INVALID_ARGUMENT);
    assert!(take(err).contains("tokens is a null pointer"));
    let tokens = [1u32, 2];
    let mut err = KilnOwnedStr::NONE;
    // SAFETY: the test passes pointers to live locals (or null on purpose) and handles the table made.
    let status = unsafe {
        (api.prefill.unwrap())(e, 0, tokens.as_ptr(), 2, logits.as_mut_ptr(), 4, &mut err)
    };
    assert_eq!(status, KilnStatus::OK);
    assert_eq!(logits, [1.0; 4]);

    // Error kinds travel as their status.
    let mut err = KilnOwnedStr::NONE;
    // SAFETY: the test passes pointers to live locals (or null on purpose) and handles the table made.
    let status = unsafe { (api.truncate_sequence.unwrap())(e, 0, 0, &mut err) };
    assert_eq!(status, KilnStatus::INVALID_ARGUMENT);
    assert_eq!(take(err), "nothing to truncate");

    // A panic is caught, reported (the payload alone: the host names the function), and
    // poisons the executor.
    let item = KilnDecodeItem { seq: 0, token: 1 };
    let mut err = KilnOwnedStr::NONE;
    // SAFETY: the test passes pointers to live locals (or null on purpose) and handles the table made.
    let status = unsafe { (api.decode.unwrap())(e, &item, 1, logits.as_mut_ptr(), 4, &mut err) };
    assert_eq!(status, KilnStatus::PANIC);
    assert_eq!(take(err), "tiny decode panics");
    let mut len = 0u64;
    let mut err = KilnOwnedStr::NONE;
    // SAFETY: the test passes pointers to live locals (or null on purpose) and handles the table made.
    let status = unsafe { (api.sequence_len.unwrap())(e, 0, &mut len, &mut err) };
    assert_eq!(status, KilnStatus::ERROR);
    assert_eq!(
        take(err),
        "executor is unusable after an earlier panic in decode: tiny decode panics"
    );

    // SAFETY: the test passes pointers to live locals (or null on purpose) and handles the table made.
    unsafe {
        (api.free_executor.unwrap())(e);
        (api.destroy_backend.unwrap())(b);
    }
    drop(buf);
}

/// Loads `tiny_model` with `options` and returns what `Tiny::load` was given, or the error.
fn load_with(
    options: &KilnLoadOptions,
) -> std::result::Result<(usize, bool), (KilnStatus, String)> {
    let (api, b) = (api(), backend());
    let model = tiny_model();
    let buf = ModelDescBuf::new(&model, ABI_VERSION).unwrap();
    let desc = buf.desc();
    let mut info = KilnExecutorInfo {
        struct_size: 24,
        _reserved: 0,
        max_context: 0,
        max_sequences: 0,
    };
    let mut e = std::ptr::null_mut();
    let mut err = KilnOwnedStr::NONE;
    // SAFETY: the test passes pointers to live locals (or null on purpose) and handles the table made.
    let status = unsafe { (api.load.unwrap())(b, &desc, options, &mut e, &mut info, &mut err) };
    let result = if status == KilnStatus::OK {
        // SAFETY: the test passes pointers to live locals (or null on purpose) and handles the table made.
        unsafe { (api.free_executor.unwrap())(e) };
        let loads = LOADS.lock().unwrap();
        Ok(*loads
            .iter()
            .rev()
            .find(|(ctx, _)| *ctx == options.max_context as usize)
            .expect("Tiny::load was called"))
    } else {
        Err((status, take(err)))
    };
    // SAFETY: the test passes pointers to live locals (or null on purpose) and handles the table made.
    unsafe { (api.destroy_backend.unwrap())(b) };
    result
}

#[test]
fn load_flags_reach_the_backend_and_a_1_0_host_gets_the_defaults() {
    let options = |max_context: u64, struct_size: u32, flags: u32| KilnLoadOptions {
        struct_size,
        _reserved: 0,
        max_context,
        max_sequences: 0,
        threads: 0,
        progress: None,
        progress_user: std::ptr::null_mut(),
        flags,
        _reserved1: 0,
    };
    let full = std::mem::size_of::<KilnLoadOptions>() as u32;
    assert_eq!(
        load_with(&options(1001, full, load_flags::QUANTIZED_ACTIVATIONS)),
        Ok((1001, true))
    );
    assert_eq!(load_with(&options(1002, full, 0)), Ok((1002, false)));
    // Bits a newer host may define are permissions this SDK declines, not errors.
    assert_eq!(
        load_with(&options(1003, full, !load_flags::QUANTIZED_ACTIVATIONS)),
        Ok((1003, false))
    );

    // A 1.0 host's struct ends before `flags`: set bits in memory past its `struct_size`
    // must not be read, so the backend gets the default.
    let v1_0 = options(1004, LOAD_OPTIONS_SIZE_V1_0, !0);
    assert_eq!(
        LOAD_OPTIONS_SIZE_V1_0 as usize,
        4 + 4 + 3 * 8 + 2 * std::mem::size_of::<usize>()
    );
    assert_eq!(load_with(&v1_0), Ok((1004, false)));

    // Shorter than 1.0's fields is refused, not read.
    let (status, msg) = load_with(&options(1005, LOAD_OPTIONS_SIZE_V1_0 - 8, 0)).unwrap_err();
    assert_eq!(status, KilnStatus::INVALID_ARGUMENT);
    assert!(
        msg.contains(&format!("struct_size {}", LOAD_OPTIONS_SIZE_V1_0 - 8)),
        "{msg}"
    );
    assert!(!LOADS.lock().unwrap().iter().any(|(ctx, _)| *ctx == 1005));
}
