//! The tokenizer a GGUF file carries in its `tokenizer.ggml.*` metadata.
//!
//! Two families, as llama.cpp names them in `tokenizer.ggml.model`:
//!
//! - `gpt2`: byte-level BPE from vocab + merges. Pre-tokenization follows
//!   `tokenizer.ggml.pre` (each name is the split of the original Hugging Face
//!   tokenizer.json), and the ranks come from the merge list. Built on the `tokenizers`
//!   crate's BPE model and pre-tokenizers.
//! - `llama`: SentencePiece BPE by token scores with `▁` for spaces, an optional leading
//!   space, and `<0xXX>` byte fallback ([`spm`]).
//!
//! Control and user-defined tokens (`<|im_start|>` ...) are cut out of the text before the
//! model sees it, so they always come out as one id. Control tokens are only recognised
//! when the caller asks (`parse_special`): text from a user must not be able to forge a turn
//! boundary. User-defined tokens are always recognised, as llama.cpp does.
//!
//! Decoding works on bytes: a token may end in the middle of a UTF-8 character (byte
//! fallback, or byte-level BPE splitting an emoji), so [`DecodeStream`] holds incomplete
//! characters back until the rest arrives.

mod spm;

use std::collections::HashMap;
use std::ops::Range;

use aho_corasick::{AhoCorasick, MatchKind};
use kiln_core::{Error, Result};
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::SplitDelimiterBehavior;

use crate::gguf::{GgufFile, GgufValue};

/// Llama 3's: case-insensitive contractions, digits in groups of up to three, and newlines
/// kept with the punctuation run before them.
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's: Llama 3's with every digit on its own.
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// GPT-4o's (o200k, gpt-oss's tokenizer): words split where a run of capitals meets a
/// lowercase one, contractions kept on their word, digits in threes, and `/` kept with the
/// punctuation run before it.
const GPT4O_PATTERN: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Piece names of end-of-turn tokens used by common chat formats; any of them present in
/// the vocab as a special token stops generation alongside EOS/EOT.
const END_OF_TURN_PIECES: &[&str] = &[
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|endoftext|>",
    "<|end|>",
    "<end_of_turn>",
    "</s>",
];

/// A harmony vocabulary's end-of-turn tokens (see [`END_OF_TURN_PIECES`]).
const HARMONY_END_OF_TURN_PIECES: &[&str] = &["<|return|>", "<|call|>", "<|endoftext|>"];

/// Everything needed to build a [`Tokenizer`]; what a GGUF file's `tokenizer.ggml.*` keys
/// hold, already resolved to their defaults.
#[derive(Debug, Clone, Default)]
pub struct TokenizerSpec {
    /// `tokenizer.ggml.model`: `"gpt2"` (byte-level BPE) or `"llama"` (SentencePiece).
    pub model: String,
    /// `tokenizer.ggml.pre`: the pre-tokenizer of a `gpt2` model.
    pub pre: Option<String>,
    pub tokens: Vec<String>,
    /// Per-token scores; required by `llama` (the merge priority).
    pub scores: Option<Vec<f32>>,
    /// Per-token type: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
    pub token_types: Option<Vec<i32>>,
    /// `"left right"` pairs in rank order; required by `gpt2`.
    pub merges: Vec<String>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub unk: Option<u32>,
    pub pad: Option<u32>,
    /// Whether a prompt should start with BOS.
    pub add_bos: bool,
    /// SentencePiece: prefix a space to text at the start and after each special token.
    pub add_space_prefix: bool,
}

/// Reads a u32 id key, refusing values that do not fit.
fn id_key(file: &GgufFile, key: &str) -> Result<Option<u32>> {
    // Some converters write -1 for "no such token".
    if file
        .get(key)
        .and_then(GgufValue::as_i64)
        .is_some_and(|v| v < 0)
    {
        return Ok(None);
    }
    match file.typed(key, "unsigned integer", GgufValue::as_u64)? {
        None => Ok(None),
        Some(v) => u32::try_from(v)
            .map(Some)
            .map_err(|_| Error::Format(format!("{key} = {v} is not a token id"))),
    }
}

impl TokenizerSpec {
    /// Reads the tokenizer keys of a GGUF file. Defaults follow llama.cpp: `llama` models
    /// add BOS and a space prefix unless the file says otherwise, `gpt2` models do neither.
    pub fn from_gguf(file: &GgufFile) -> Result<TokenizerSpec> {
        // Every key is read strictly: one of the wrong type is an error naming it, not a
        // silent fallback to "absent".
        let model = file
            .typed("tokenizer.ggml.model", "string", GgufValue::as_str)?
            .ok_or_else(|| Error::Format("missing tokenizer.ggml.model".into()))?
            .to_string();
        let tokens = file
            .typed(
                "tokenizer.ggml.tokens",
                "array of strings",
                GgufValue::as_string_array,
            )?
            .ok_or_else(|| Error::Format("missing tokenizer.ggml.tokens".into()))?
            .to_vec();
        let is_spm = model == "llama";
        let flag = |key: &str, default: bool| -> Result<bool> {
            Ok(file
                .typed(key, "bool", GgufValue::as_bool)?
                .unwrap_or(default))
        };
        Ok(TokenizerSpec {
            pre: file
                .typed("tokenizer.ggml.pre", "string", GgufValue::as_str)?
                .map(str::to_string),
            scores: file
                .typed(
                    "tokenizer.ggml.scores",
                    "array of f32",
                    GgufValue::as_f32_array,
                )?
                .map(<[f32]>::to_vec),
            token_types: file
                .typed(
                    "tokenizer.ggml.token_type",
                    "array of i32",
                    GgufValue::as_i32_array,
                )?
                .map(<[i32]>::to_vec),
            merges: file
                .typed(
                    "tokenizer.ggml.merges",
                    "array of strings",
                    GgufValue::as_string_array,
                )?
                .map(<[String]>::to_vec)
                .unwrap_or_default(),
            bos: id_key(file, "tokenizer.ggml.bos_token_id")?,
            eos: id_key(file, "tokenizer.ggml.eos_token_id")?,
            eot: id_key(file, "tokenizer.ggml.eot_token_id")?,
            unk: id_key(file, "tokenizer.ggml.unknown_token_id")?,
            pad: id_key(file, "tokenizer.ggml.padding_token_id")?,
            add_bos: flag("tokenizer.ggml.add_bos_token", is_spm)?,
            add_space_prefix: flag("tokenizer.ggml.add_space_prefix", is_spm)?,
            model,
            tokens,
        })
    }
}

/// What a vocab entry is, from `tokenizer.ggml.token_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TokenKind {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

impl TokenKind {
    fn from_gguf(v: i32) -> TokenKind {
        match v {
            2 => TokenKind::Unknown,
            3 => TokenKind::Control,
            4 => TokenKind::UserDefined,
            5 => TokenKind::Unused,
            6 => TokenKind::Byte,
            // 0 (undefined) and anything unknown behave as ordinary text.
            _ => TokenKind::Normal,
        }
    }

    /// Tokens that `skip_special` drops when decoding.
    fn is_special(self) -> bool {
        matches!(
            self,
            TokenKind::Control | TokenKind::Unknown | TokenKind::Unused
        )
    }
}

enum Model {
    /// Byte-level BPE. Special tokens never reach it (they are cut out first), so the
    /// `tokenizers` pipeline is only pre-tokenizer + BPE model.
    Bpe(Box<tokenizers::Tokenizer>),
    Spm {
        token_to_id: HashMap<String, u32>,
        scores: Vec<f32>,
        byte_tokens: Box<[Option<u32>; 256]>,
    },
}

/// A set of special tokens cut out of text as whole ids, leftmost-longest.
struct SpecialMatcher {
    automaton: AhoCorasick,
    ids: Vec<u32>,
}

impl SpecialMatcher {
    fn new(pieces: &[String], ids: Vec<u32>) -> Result<Option<SpecialMatcher>> {
        if ids.is_empty() {
            return Ok(None);
        }
        let automaton = AhoCorasick::builder()
            .match_kind(MatchKind::LeftmostLongest)
            .build(ids.iter().map(|&id| pieces[id as usize].as_str()))
            .map_err(|e| Error::Tokenizer(format!("special-token matcher: {e}")))?;
        Ok(Some(SpecialMatcher { automaton, ids }))
    }
}

/// A tokenizer built from file metadata. Cheap to share across threads (`Send + Sync`).
pub struct Tokenizer {
    model: Model,
    pieces: Vec<String>,
    kinds: Vec<TokenKind>,
    /// Each token's text as bytes, precomputed so decoding is a lookup.
    bytes: Vec<Box<[u8]>>,
    spm: bool,
    bos: Option<u32>,
    eos: Option<u32>,
    unk: Option<u32>,
    add_bos: bool,
    add_space_prefix: bool,
    stop: Vec<u32>,
    /// Control, unknown and user-defined tokens: used when `parse_special` is true.
    specials_all: Option<SpecialMatcher>,
    /// User-defined tokens only: always matched.
    specials_user: Option<SpecialMatcher>,
}

/// GPT-2's reversible byte ↔ char map: printable bytes stand for themselves, the rest are
/// moved to U+0100 onwards so every byte has a visible, non-space character.
fn byte_level_chars() -> [char; 256] {
    let mut map = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        map[b as usize] = if printable {
            b as char
        } else {
            let c = char::from_u32(next).expect("U+0100..U+0143 are valid chars");
            next += 1;
            c
        };
    }
    map
}

/// Parses `<0xXX>`.
fn parse_byte_piece(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

fn bpe_pre_tokenizer(pre: Option<&str>) -> Result<PreTokenizerWrapper> {
    // With `use_regex`, ByteLevel applies GPT-2's split (contractions, ` ?letters`,
    // ` ?digits`, ` ?punctuation`, whitespace runs) before mapping bytes to chars.
    let byte_level =
        |use_regex| PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, use_regex));
    let split = |pattern: &str| -> Result<PreTokenizerWrapper> {
        Split::new(
            SplitPattern::Regex(pattern.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map(PreTokenizerWrapper::Split)
        .map_err(|e| Error::Tokenizer(format!("pre-tokenizer regex: {e}")))
    };
    Ok(match pre.unwrap_or("default") {
        "default" | "gpt2" | "gpt-2" | "phi-2" | "olmo" => byte_level(true),
        // SmolLM2 / StarCoder: every digit on its own, then the GPT-2 split.
        "smollm" | "starcoder" | "refact" | "codeshell" => PreTokenizerWrapper::Sequence(Sequence::new(vec![
            PreTokenizerWrapper::Digits(Digits::new(true)),
            byte_level(true),
        ])),
        "llama3" | "llama-bpe" | "llama-v3" | "smaug-bpe" | "dbrx" => {
            PreTokenizerWrapper::Sequence(Sequence::new(vec![split(LLAMA3_PATTERN)?, byte_level(false)]))
        }
        "qwen2" | "deepseek-r1-qwen" => {
            PreTokenizerWrapper::Sequence(Sequence::new(vec![split(QWEN2_PATTERN)?, byte_level(false)]))
        }
        "gpt-4o" => {
            PreTokenizerWrapper::Sequence(Sequence::new(vec![split(GPT4O_PATTERN)?, byte_level(false)]))
        }
        other => {
            return Err(Error::Unsupported(format!(
                "pre-tokenizer '{other}' (known: gpt2/default, smollm/starcoder, llama-bpe/llama3, qwen2, gpt-4o)"
            )))
        }
    })
}

/// `gpt2`'s BPE over the `tokenizers` crate. A piece listed twice maps to its first id.
fn build_bpe(spec: &TokenizerSpec) -> Result<Model> {
    let mut vocab = Vocab::default();
    for (id, piece) in spec.tokens.iter().enumerate() {
        vocab.entry(piece.clone()).or_insert(id as u32);
    }
    let merges = spec
        .merges
        .iter()
        .map(|m| {
            // A merge is "left right"; the left part may itself start with a space char in
            // non-byte-level vocabs, so split at the first space after the first byte.
            let first = m.chars().next().map_or(0, char::len_utf8);
            let cut = m[first..].find(' ').map(|i| i + first);
            match cut {
                Some(i) => Ok((m[..i].to_string(), m[i + 1..].to_string())),
                None => Err(Error::Format(format!("merge '{m}' is not 'left right'"))),
            }
        })
        .collect::<Result<Vec<_>>>()?;
    let ignore_merges = matches!(
        spec.pre.as_deref(),
        Some("llama3" | "llama-bpe" | "llama-v3")
    );
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(ignore_merges)
        .build()
        .map_err(|e| Error::Format(format!("BPE vocab/merges: {e}")))?;
    let mut tok = tokenizers::Tokenizer::new(bpe);
    tok.with_pre_tokenizer(Some(bpe_pre_tokenizer(spec.pre.as_deref())?));
    Ok(Model::Bpe(Box::new(tok)))
}

fn build_spm(spec: &TokenizerSpec, kinds: &[TokenKind]) -> Result<Model> {
    let scores = spec.scores.clone().ok_or_else(|| {
        Error::Format("llama (SentencePiece) tokenizer without tokenizer.ggml.scores".into())
    })?;
    if scores.len() != spec.tokens.len() {
        return Err(Error::Format(format!(
            "{} scores for {} tokens",
            scores.len(),
            spec.tokens.len()
        )));
    }
    let mut token_to_id = HashMap::with_capacity(spec.tokens.len());
    let mut byte_tokens = Box::new([None; 256]);
    for (id, piece) in spec.tokens.iter().enumerate() {
        token_to_id.entry(piece.clone()).or_insert(id as u32);
        if kinds[id] == TokenKind::Byte || spec.token_types.is_none() {
            if let Some(b) = parse_byte_piece(piece) {
                byte_tokens[b as usize].get_or_insert(id as u32);
            }
        }
    }
    // Vocabs without byte tokens may still hold single ASCII characters.
    for b in 0..128u8 {
        if byte_tokens[b as usize].is_none() {
            byte_tokens[b as usize] = token_to_id.get((b as char).to_string().as_str()).copied();
        }
    }
    Ok(Model::Spm {
        token_to_id,
        scores,
        byte_tokens,
    })
}

impl Tokenizer {
    /// Builds the tokenizer; fails with a typed error on inconsistent metadata (ids out of
    /// range, lengths that disagree, merges naming unknown tokens, unknown pre-tokenizer).
    pub fn from_spec(spec: TokenizerSpec) -> Result<Tokenizer> {
        let n = spec.tokens.len();
        if n == 0 {
            return Err(Error::Format("tokenizer has an empty vocabulary".into()));
        }
        if u32::try_from(n).is_err() {
            return Err(Error::Format(format!(
                "vocabulary of {n} tokens does not fit u32 ids"
            )));
        }
        for (name, id) in [
            ("bos", spec.bos),
            ("eos", spec.eos),
            ("eot", spec.eot),
            ("unk", spec.unk),
            ("pad", spec.pad),
        ] {
            if let Some(id) = id {
                if id as usize >= n {
                    return Err(Error::Format(format!(
                        "{name} token id {id} outside vocabulary of {n}"
                    )));
                }
            }
        }
        let kinds: Vec<TokenKind> = match &spec.token_types {
            Some(types) if types.len() != n => {
                return Err(Error::Format(format!(
                    "{} token types for {n} tokens",
                    types.len()
                )))
            }
            Some(types) => types.iter().map(|&t| TokenKind::from_gguf(t)).collect(),
            None => {
                // Without types, the ids the metadata names are the only known specials.
                let mut kinds = vec![TokenKind::Normal; n];
                for id in [spec.bos, spec.eos, spec.eot, spec.pad]
                    .into_iter()
                    .flatten()
                {
                    kinds[id as usize] = TokenKind::Control;
                }
                if let Some(unk) = spec.unk {
                    kinds[unk as usize] = TokenKind::Unknown;
                }
                kinds
            }
        };

        let (model, spm) = match spec.model.as_str() {
            "gpt2" => (build_bpe(&spec)?, false),
            "llama" => (build_spm(&spec, &kinds)?, true),
            other => {
                return Err(Error::Unsupported(format!(
                    "tokenizer model '{other}' (supported: gpt2, llama)"
                )))
            }
        };

        let byte_chars = byte_level_chars();
        let byte_of: HashMap<char, u8> = byte_chars
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect();
        let bytes = spec
            .tokens
            .iter()
            .zip(&kinds)
            .map(|(piece, kind)| -> Box<[u8]> {
                match kind {
                    TokenKind::Normal if spm => piece.replace('\u{2581}', " ").into_bytes().into(),
                    TokenKind::Normal => {
                        let mut out = Vec::with_capacity(piece.len());
                        for c in piece.chars() {
                            match byte_of.get(&c) {
                                Some(&b) => out.push(b),
                                // Not a byte-level char: keep the text as written.
                                None => {
                                    out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes())
                                }
                            }
                        }
                        out.into()
                    }
                    TokenKind::Byte => match parse_byte_piece(piece) {
                        Some(b) => Box::new([b]),
                        None => piece.as_bytes().into(),
                    },
                    _ => piece.as_bytes().into(),
                }
            })
            .collect();

        let special_ids = |pred: &dyn Fn(TokenKind) -> bool| -> Vec<u32> {
            let mut ids: Vec<u32> = (0..n)
                .filter(|&i| pred(kinds[i]) && !spec.tokens[i].is_empty())
                .map(|i| i as u32)
                .collect();
            // Duplicated pieces: keep the lowest id so matching is deterministic.
            let mut seen = std::collections::HashSet::new();
            ids.retain(|&i| seen.insert(spec.tokens[i as usize].as_str()));
            ids
        };
        let specials_all = SpecialMatcher::new(
            &spec.tokens,
            special_ids(&|k| {
                matches!(
                    k,
                    TokenKind::Control | TokenKind::UserDefined | TokenKind::Unknown
                )
            }),
        )?;
        let specials_user =
            SpecialMatcher::new(&spec.tokens, special_ids(&|k| k == TokenKind::UserDefined))?;

        let mut stop: Vec<u32> = Vec::new();
        for id in [spec.eos, spec.eot].into_iter().flatten() {
            if !stop.contains(&id) {
                stop.push(id);
            }
        }
        // Harmony (gpt-oss) ends a turn with `<|return|>` or a tool call with `<|call|>`;
        // its `<|end|>` closes one message of several (the reasoning before the answer).
        let harmony = ["<|channel|>", "<|message|>"]
            .iter()
            .all(|m| spec.tokens.iter().any(|t| t == m));
        for (i, piece) in spec.tokens.iter().enumerate() {
            let id = i as u32;
            let ends_turn = match harmony {
                true => HARMONY_END_OF_TURN_PIECES.contains(&piece.as_str()),
                false => END_OF_TURN_PIECES.contains(&piece.as_str()),
            };
            if ends_turn
                && matches!(kinds[i], TokenKind::Control | TokenKind::UserDefined)
                && !stop.contains(&id)
            {
                stop.push(id);
            }
        }

        let unk = spec.unk.or_else(|| {
            kinds
                .iter()
                .position(|&k| k == TokenKind::Unknown)
                .map(|i| i as u32)
        });
        Ok(Tokenizer {
            model,
            kinds,
            bytes,
            spm,
            bos: spec.bos,
            eos: spec.eos,
            unk,
            add_bos: spec.add_bos && spec.bos.is_some(),
            add_space_prefix: spec.add_space_prefix,
            stop,
            specials_all,
            specials_user,
            pieces: spec.tokens,
        })
    }

    /// Whether this is byte-level BPE (`gpt2`), whose decoding gives any encoded text
    /// back exactly, rather than SentencePiece.
    pub fn is_byte_level(&self) -> bool {
        !self.spm
    }

    /// Reads the tokenizer of a GGUF file.
    pub fn from_gguf(file: &GgufFile) -> Result<Tokenizer> {
        Tokenizer::from_spec(TokenizerSpec::from_gguf(file)?)
    }

    /// Token ids for `text`. `add_bos` prepends BOS (an error if the model has none);
    /// `parse_special` lets control tokens written in the text (`<|im_start|>`) become
    /// their ids instead of being spelled out.
    pub fn encode(&self, text: &str, add_bos: bool, parse_special: bool) -> Result<Vec<u32>> {
        let matcher = if parse_special {
            &self.specials_all
        } else {
            &self.specials_user
        };
        self.encode_cut(text, add_bos, matcher.as_ref(), &[])
    }

    /// Token ids for a chat prompt: control tokens written in `text` become their ids,
    /// except inside the byte ranges `plain` (the messages' content), where only
    /// user-defined tokens do, as in [`Tokenizer::encode`] without `parse_special`. So a
    /// message that spells `<|im_end|>` stays text and cannot close its turn; the text
    /// around it is encoded in one run, exactly as without the ranges.
    pub fn encode_chat(
        &self,
        text: &str,
        add_bos: bool,
        plain: &[Range<usize>],
    ) -> Result<Vec<u32>> {
        self.encode_cut(text, add_bos, self.specials_all.as_ref(), plain)
    }

    /// Encodes `text`, cutting out as whole ids the tokens `matcher` finds, but for those
    /// that reach into a `plain` range and are not user-defined (each such is skipped and
    /// the search goes on from its next byte, so a token it overlapped may still match).
    fn encode_cut(
        &self,
        text: &str,
        add_bos: bool,
        matcher: Option<&SpecialMatcher>,
        plain: &[Range<usize>],
    ) -> Result<Vec<u32>> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_bos {
            out.push(self.bos.ok_or_else(|| {
                Error::Tokenizer("BOS requested but the model defines no BOS token".into())
            })?);
        }
        let mut last = 0;
        let mut after_special = true;
        if let Some(m) = matcher {
            let mut from = 0;
            while let Some(hit) = m
                .automaton
                .find(aho_corasick::Input::new(text).span(from..text.len()))
            {
                let id = m.ids[hit.pattern().as_usize()];
                let in_plain = plain
                    .iter()
                    .any(|r| hit.start() < r.end && r.start < hit.end());
                if in_plain && self.kinds.get(id as usize) != Some(&TokenKind::UserDefined) {
                    from = hit.start() + 1;
                    continue;
                }
                self.encode_text(&text[last..hit.start()], after_special, &mut out)?;
                out.push(id);
                after_special = true;
                last = hit.end();
                from = hit.end();
            }
        }
        self.encode_text(&text[last..], after_special, &mut out)?;
        Ok(out)
    }

    /// Runs the model on text that holds no special token.
    fn encode_text(&self, text: &str, after_special: bool, out: &mut Vec<u32>) -> Result<()> {
        if text.is_empty() {
            return Ok(());
        }
        match &self.model {
            Model::Bpe(tok) => {
                let enc = tok
                    .encode_fast(text, false)
                    .map_err(|e| Error::Tokenizer(format!("BPE encode: {e}")))?;
                out.extend_from_slice(enc.get_ids());
                Ok(())
            }
            Model::Spm {
                token_to_id,
                scores,
                byte_tokens,
            } => {
                let mut escaped = String::with_capacity(text.len() + 3);
                if self.add_space_prefix && after_special {
                    escaped.push('\u{2581}');
                }
                escaped.extend(text.chars().map(|c| if c == ' ' { '\u{2581}' } else { c }));
                let vocab = spm::SpmVocab {
                    token_to_id,
                    scores,
                    byte_tokens,
                    unk: self.unk,
                };
                spm::tokenize(&vocab, &escaped, out)
            }
        }
    }

    /// The text of `ids`. `skip_special` drops control tokens (BOS, `<|im_end|>` ...).
    /// Ids outside the vocabulary show as U+FFFD; bytes that do not form UTF-8 likewise.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        let mut stream = self.decode_stream(skip_special);
        let mut text = String::new();
        for &id in ids {
            if let Some(s) = stream.push(id) {
                text.push_str(&s);
            }
        }
        if let Some(s) = stream.flush() {
            text.push_str(&s);
        }
        text
    }

    /// A decoder for tokens arriving one at a time.
    pub fn decode_stream(&self, skip_special: bool) -> DecodeStream<'_> {
        DecodeStream {
            tokenizer: self,
            skip_special,
            pending: Vec::new(),
            at_start: true,
        }
    }

    /// The raw vocab string of a token (byte-level or `▁`-escaped as stored in the file).
    pub fn piece(&self, id: u32) -> Option<&str> {
        self.pieces.get(id as usize).map(String::as_str)
    }

    /// The bytes token `id` adds to decoded text (a byte-level token's bytes, a
    /// SentencePiece piece with `▁` as a space, a byte token's byte) — what a
    /// constraint on the output text matches tokens by. `None` outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.bytes.get(id as usize).map(|b| &b[..])
    }

    /// The id of a vocab string, if it is one token.
    pub fn token_id(&self, piece: &str) -> Option<u32> {
        self.pieces
            .iter()
            .position(|p| p == piece)
            .map(|i| i as u32)
    }

    /// Whether `id` is a control/unknown/unused token (what `skip_special` drops).
    pub fn is_special(&self, id: u32) -> bool {
        self.kinds.get(id as usize).is_some_and(|k| k.is_special())
    }

    pub fn vocab_size(&self) -> usize {
        self.pieces.len()
    }

    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// Ids that end a generation: EOS, EOT, and the end-of-turn control tokens the vocab
    /// holds (`<|im_end|>`, `<|eot_id|>`, `<|endoftext|>`, `<end_of_turn>` ...).
    pub fn stop_tokens(&self) -> &[u32] {
        &self.stop
    }

    /// Whether a prompt should start with BOS, as the file asks (false without a BOS).
    pub fn add_bos_default(&self) -> bool {
        self.add_bos
    }
}

/// Turns a stream of token ids into text, emitting only complete UTF-8 characters: a
/// character split across tokens is held until its last byte arrives.
pub struct DecodeStream<'a> {
    tokenizer: &'a Tokenizer,
    skip_special: bool,
    pending: Vec<u8>,
    /// SentencePiece's prefix space is dropped from the first token that shows text.
    at_start: bool,
}

impl DecodeStream<'_> {
    /// Adds one token; returns the text that became complete, if any.
    pub fn push(&mut self, id: u32) -> Option<String> {
        let tok = self.tokenizer;
        match tok.bytes.get(id as usize) {
            None => self.pending.extend_from_slice("\u{FFFD}".as_bytes()),
            Some(bytes) => {
                if self.skip_special && tok.kinds[id as usize].is_special() {
                    return None;
                }
                let mut bytes: &[u8] = bytes;
                if self.at_start && !bytes.is_empty() {
                    if tok.spm
                        && tok.add_space_prefix
                        && tok.kinds[id as usize] == TokenKind::Normal
                    {
                        bytes = bytes.strip_prefix(b" ").unwrap_or(bytes);
                    }
                    self.at_start = false;
                }
                self.pending.extend_from_slice(bytes);
            }
        }
        self.take_complete()
    }

    /// Emits whatever is left, incomplete characters as U+FFFD. Call at end of stream.
    pub fn flush(&mut self) -> Option<String> {
        if self.pending.is_empty() {
            return None;
        }
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        Some(s)
    }

    fn take_complete(&mut self) -> Option<String> {
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(std::str::from_utf8(&rest[..valid]).expect("valid prefix"));
                    match e.error_len() {
                        // Bytes that can never become a character: show them as replaced.
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            rest = &rest[valid + bad..];
                        }
                        // A character cut short: wait for the next token.
                        None => {
                            rest = &rest[valid..];
                            break;
                        }
                    }
                }
            }
        }
        let keep = rest.len();
        let len = self.pending.len();
        self.pending.drain(..len - keep);
        (!out.is_empty()).then_some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

    /// GPT-4o's split of a string that exercises each alternative, against what Python's
    /// `regex` module gives for tiktoken's o200k pattern (written out below).
    #[test]
    fn gpt4o_pattern_splits_as_tiktoken_does() {
        let split = Split::new(
            SplitPattern::Regex(GPT4O_PATTERN.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .unwrap();
        let text =
            "Hello WORLD's camelCase 12345 don't!!\n\n  x/y\r\npath/to  end ÀÉclair naïve 東京 ";
        let mut pre = PreTokenizedString::from(text);
        split.pre_tokenize(&mut pre).unwrap();
        let pieces: Vec<String> = pre
            .get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(p, _, _)| p.to_string())
            .collect();
        let want = [
            "Hello",
            " WORLD's",
            " camel",
            "Case",
            " ",
            "123",
            "45",
            " don't",
            "!!\n\n",
            " ",
            " x",
            "/y",
            "\r\n",
            "path",
            "/to",
            " ",
            " end",
            " ÀÉclair",
            " naïve",
            " 東京",
            " ",
        ];
        assert_eq!(pieces, want);
    }
}
