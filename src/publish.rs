//! `sfx publish`: send a conversion's output folder to a Hugging Face Hub model repository.
//!
//! The folder is verified first (every file against its manifest, `model.sfx`'s section
//! checksums) and must hold exactly what its manifest lists, so what is published is what was
//! checked. The upload itself is the Hub's official client, `hf upload REPO out/ .`
//! (huggingface_hub 2.x, `pip install -U huggingface_hub`): large-file aware, split into several
//! commits, resumed by running it again, and it creates the repository when it does not exist
//! (1.x called this `upload-large-folder`; 2.x folded it into `upload`). Writing our own LFS
//! upload would duplicate it for no gain. The token is the client's: `HF_TOKEN`, or the file `hf auth login` writes
//! (`$HF_TOKEN_PATH`, else `$HF_HOME/token`, else `~/.cache/huggingface/token`); this command
//! only checks that one exists, so a missing token is named before anything is sent.

use anyhow::{anyhow, bail, Context, Result};
use sfx_formats::package::{verify_folder, FileEntry, MANIFEST_FILE};
use std::path::PathBuf;
use std::process::Command;

/// What `sfx publish` was asked for (its command-line arguments).
#[derive(clap::Args)]
pub struct PublishArgs {
    /// The output folder (`sfx-convert … -o DIR/`).
    pub folder: PathBuf,
    /// The Hub repository, namespace/name.
    #[arg(long)]
    pub repo: String,
    /// Create the repository private (an existing repository keeps its visibility).
    #[arg(long)]
    pub private: bool,
    /// Branch to publish to (default: main).
    #[arg(long)]
    pub revision: Option<String>,
    /// Verify and list what would be sent; send nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Where the Hub token was found (never the token itself).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenSource {
    Env(&'static str),
    File(PathBuf),
}

impl std::fmt::Display for TokenSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TokenSource::Env(name) => write!(f, "the environment variable {name}"),
            TokenSource::File(p) => write!(f, "the file {}", p.display()),
        }
    }
}

/// Everything one publication sends and how: the dry run prints it, the real run does it.
pub struct Plan {
    pub folder: PathBuf,
    pub repo: String,
    pub revision: Option<String>,
    pub private: bool,
    /// Every file sent, by name, with its verified size and SHA-256 (the manifest included).
    pub files: Vec<(String, FileEntry)>,
    pub sections_checked: usize,
    pub token: Option<TokenSource>,
    /// The Hub client found, and the command line that uploads.
    pub client: Option<PathBuf>,
    pub command: Vec<String>,
}

impl Plan {
    pub fn total_bytes(&self) -> u64 {
        self.files.iter().map(|(_, e)| e.bytes).sum()
    }

    fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "folder": self.folder.display().to_string(),
            "repo": self.repo,
            "url": format!("https://huggingface.co/{}", self.repo),
            "revision": self.revision.as_deref().unwrap_or("main"),
            "private": self.private,
            "files": self.files.iter().map(|(n, e)| serde_json::json!({
                "name": n, "bytes": e.bytes, "sha256": e.sha256,
            })).collect::<Vec<_>>(),
            "bytes": self.total_bytes(),
            "sections_checked": self.sections_checked,
            "token": self.token.as_ref().map(|t| t.to_string()),
            "client": self.client.as_ref().map(|c| c.display().to_string()),
            "command": self.command,
        })
    }
}

/// Checks a Hub model id as the Hub does: `namespace/name`, each part letters, digits, `-`,
/// `_` and `.`, not starting or ending with `-` or `.`, no `--` or `..`, at most 96 characters
/// in all, the name not ending in `.git`.
pub fn check_repo_id(id: &str) -> Result<()> {
    let bad = |why: &str| {
        anyhow!("--repo {id:?}: {why} (expected namespace/name, e.g. my-org/SmolLM2-135M-sfx-awq3)")
    };
    let Some((ns, name)) = id.split_once('/') else {
        return Err(bad("no namespace"));
    };
    if id.len() > 96 {
        return Err(bad("longer than 96 characters"));
    }
    for part in [ns, name] {
        if part.is_empty() {
            return Err(bad("an empty part"));
        }
        if !part
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        {
            return Err(bad(
                "only letters, digits, '-', '_' and '.' are allowed in each part",
            ));
        }
        if part.starts_with(['-', '.']) || part.ends_with(['-', '.']) {
            return Err(bad("a part starts or ends with '-' or '.'"));
        }
        if part.contains("--") || part.contains("..") {
            return Err(bad("'--' and '..' are not allowed"));
        }
    }
    if name.ends_with(".git") {
        return Err(bad("the name ends in .git"));
    }
    Ok(())
}

/// Where the Hub client would find a token, looked up in its own order, from the given
/// environment (a function, so tests need not touch the process's).
pub fn find_token(env: impl Fn(&str) -> Option<String>) -> Option<TokenSource> {
    let set = |name: &str| env(name).filter(|v| !v.trim().is_empty());
    for name in ["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"] {
        if set(name).is_some() {
            // Static names for the Display above.
            return Some(TokenSource::Env(if name == "HF_TOKEN" {
                "HF_TOKEN"
            } else {
                "HUGGING_FACE_HUB_TOKEN"
            }));
        }
    }
    let file = if let Some(p) = set("HF_TOKEN_PATH") {
        PathBuf::from(p)
    } else if let Some(home) = set("HF_HOME") {
        PathBuf::from(home).join("token")
    } else if let Some(cache) = set("XDG_CACHE_HOME") {
        PathBuf::from(cache).join("huggingface/token")
    } else {
        PathBuf::from(set("HOME")?).join(".cache/huggingface/token")
    };
    let text = std::fs::read_to_string(&file).ok()?;
    (!text.trim().is_empty()).then_some(TokenSource::File(file))
}

/// The Hub client: `SFX_HF_CLI` if set, else `hf`, else the older `huggingface-cli`, on PATH.
fn find_client() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("SFX_HF_CLI").filter(|p| !p.is_empty()) {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    ["hf", "huggingface-cli"].iter().find_map(|name| {
        std::env::split_paths(&path)
            .map(|d| d.join(name))
            .find(|p| p.is_file())
    })
}

/// Verifies the folder and lays out the publication. Refuses a folder holding anything its
/// manifest does not list (it would be sent unchecked); the client's own resume state
/// (`.cache/`) is the one hidden entry allowed.
pub fn plan(a: &PublishArgs) -> Result<Plan> {
    check_repo_id(&a.repo)?;
    if let Some(r) = &a.revision {
        if r.is_empty() || r.chars().any(|c| c.is_whitespace() || c.is_control()) {
            bail!("--revision {r:?}: not a branch name");
        }
    }
    if !a.folder.is_dir() {
        bail!(
            "{}: not an output folder (publish takes the folder `sfx-convert … -o DIR/` wrote)",
            a.folder.display()
        );
    }
    let report = verify_folder(&a.folder)
        .with_context(|| format!("verifying {} before publishing", a.folder.display()))?;
    let mut stray: Vec<String> = report.unlisted.clone();
    for e in std::fs::read_dir(&a.folder).with_context(|| a.folder.display().to_string())? {
        let name = e?.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') && name != ".cache" {
            stray.push(name);
        }
    }
    if !stray.is_empty() {
        bail!(
            "{}: {} not listed in {MANIFEST_FILE} ({}); publish sends only what the manifest \
             lists and verify checked — move them out of the folder",
            a.folder.display(),
            if stray.len() == 1 {
                "a file is"
            } else {
                "files are"
            },
            stray.join(", ")
        );
    }
    let mut files: Vec<(String, FileEntry)> = report.checked.into_iter().collect();
    files.push((MANIFEST_FILE.to_string(), report.manifest));
    let client = find_client();
    let mut command = vec![
        client
            .as_ref()
            .map_or_else(|| "hf".to_string(), |c| c.display().to_string()),
        "upload".into(),
        a.repo.clone(),
        a.folder.display().to_string(),
        // The folder's files at the repository's root.
        ".".into(),
    ];
    if let Some(r) = &a.revision {
        command.extend(["--revision".into(), r.clone()]);
    }
    if a.private {
        command.push("--private".into());
    }
    Ok(Plan {
        folder: a.folder.clone(),
        repo: a.repo.clone(),
        revision: a.revision.clone(),
        private: a.private,
        files,
        sections_checked: report.sections,
        token: find_token(|k| std::env::var(k).ok()),
        client,
        command,
    })
}

fn print_plan(p: &Plan, dry_run: bool) {
    println!(
        "{} {} to https://huggingface.co/{} (revision {}, {})",
        if dry_run {
            "would publish"
        } else {
            "publishing"
        },
        p.folder.display(),
        p.repo,
        p.revision.as_deref().unwrap_or("main"),
        if p.private { "private" } else { "public" }
    );
    println!(
        "verified: {} files, {} bytes; {} sections of model.sfx checked",
        p.files.len(),
        p.total_bytes(),
        p.sections_checked
    );
    let width = p.files.iter().map(|(n, _)| n.len()).max().unwrap_or(0);
    for (name, e) in &p.files {
        println!(
            "  {name:<width$}  {:>14} bytes  sha256 {}",
            e.bytes, e.sha256
        );
    }
    match &p.token {
        Some(t) => println!("token: found in {t}"),
        None => println!("token: none found (set HF_TOKEN or run `hf auth login`)"),
    }
    match &p.client {
        Some(c) => println!("client: {}", c.display()),
        None => println!("client: not found (pip install -U huggingface_hub)"),
    }
    println!("command: {}", p.command.join(" "));
}

pub fn run(a: PublishArgs) -> Result<()> {
    let p = plan(&a)?;
    if a.dry_run {
        if a.json {
            println!("{}", serde_json::to_string_pretty(&p.to_json())?);
        } else {
            print_plan(&p, true);
        }
        return Ok(());
    }
    if p.token.is_none() {
        bail!(
            "no Hugging Face token: set HF_TOKEN, or run `hf auth login` (it writes \
             ~/.cache/huggingface/token); nothing was sent"
        );
    }
    let Some(client) = &p.client else {
        bail!(
            "the Hugging Face client `hf` is not on PATH: `pip install -U huggingface_hub` \
             (or point SFX_HF_CLI at it); nothing was sent"
        );
    };
    if !a.json {
        print_plan(&p, false);
    }
    let status = Command::new(client)
        .args(&p.command[1..])
        .status()
        .with_context(|| format!("running {}", client.display()))?;
    if !status.success() {
        bail!(
            "{} exited with {status}: the upload did not finish (run the same command again \
             to resume it)",
            client.display()
        );
    }
    if a.json {
        let mut v = p.to_json();
        v["published"] = serde_json::Value::Bool(true);
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!("published https://huggingface.co/{}", p.repo);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An environment of the given variables only.
    fn env_of<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| (*v).to_string())
        }
    }

    #[test]
    fn repo_ids_are_checked_as_the_hub_does() {
        for ok in ["org/name", "my-org/SmolLM2-135M.sfx_awq3", "a/b"] {
            check_repo_id(ok).unwrap();
        }
        for bad in [
            "name",
            "/name",
            "org/",
            "org/na me",
            "org/-name",
            "org/name.",
            "org/a--b",
            "org/a..b",
            "org/name.git",
            "org/sub/name",
        ] {
            assert!(check_repo_id(bad).is_err(), "{bad} accepted");
        }
        assert!(check_repo_id(&format!("o/{}", "n".repeat(95))).is_err());
    }

    #[test]
    fn token_lookup_follows_the_client_order() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_str().unwrap();
        // Nothing anywhere.
        assert_eq!(find_token(env_of(&[("HOME", d)])), None);
        // An empty variable does not count.
        assert_eq!(find_token(env_of(&[("HF_TOKEN", " "), ("HOME", d)])), None);
        assert_eq!(
            find_token(env_of(&[
                ("HF_TOKEN", "x"),
                ("HUGGING_FACE_HUB_TOKEN", "y")
            ])),
            Some(TokenSource::Env("HF_TOKEN"))
        );
        assert_eq!(
            find_token(env_of(&[("HUGGING_FACE_HUB_TOKEN", "y")])),
            Some(TokenSource::Env("HUGGING_FACE_HUB_TOKEN"))
        );
        // ~/.cache/huggingface/token, then $HF_HOME/token over it, then $HF_TOKEN_PATH.
        let home_token = dir.path().join(".cache/huggingface/token");
        std::fs::create_dir_all(home_token.parent().unwrap()).unwrap();
        std::fs::write(&home_token, "hf_abc\n").unwrap();
        assert_eq!(
            find_token(env_of(&[("HOME", d)])),
            Some(TokenSource::File(home_token.clone()))
        );
        let hf_home = dir.path().join("hfhome");
        std::fs::create_dir_all(&hf_home).unwrap();
        // HF_HOME set but holding no token: the client does not fall back to ~/.cache.
        assert_eq!(
            find_token(env_of(&[
                ("HOME", d),
                ("HF_HOME", hf_home.to_str().unwrap())
            ])),
            None
        );
        std::fs::write(hf_home.join("token"), "hf_def").unwrap();
        assert_eq!(
            find_token(env_of(&[
                ("HOME", d),
                ("HF_HOME", hf_home.to_str().unwrap())
            ])),
            Some(TokenSource::File(hf_home.join("token")))
        );
        let explicit = dir.path().join("my-token");
        std::fs::write(&explicit, "hf_ghi").unwrap();
        assert_eq!(
            find_token(env_of(&[
                ("HOME", d),
                ("HF_HOME", hf_home.to_str().unwrap()),
                ("HF_TOKEN_PATH", explicit.to_str().unwrap())
            ])),
            Some(TokenSource::File(explicit))
        );
    }
}
