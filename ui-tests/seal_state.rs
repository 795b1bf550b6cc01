// `State` is sealed: no state can be added outside the crate.
enum MyState {}

impl memtoken::State for MyState {
    const NAME: &'static str = "x";
}

fn main() {}
